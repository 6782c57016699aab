"""The `omni` command as a user runs it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.testing.configs import tiny_config, write_config

# The console script next to this interpreter: the one `pip install -e .` made.
REPO = Path(__file__).resolve().parents[1]
OMNI = str(Path(sys.executable).parent / "omni")


def test_stage_run_starts_a_stage_answers_and_stops(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    config = write_config(tmp_path / "tiny.yaml", tiny_config("tiny", omni_cache_dir))
    done = subprocess.run(
        [OMNI, "stage", "run", "--config", str(config), "--max-tokens", "5", "Hello"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "[tiny] READY" in done.stderr
    assert len(done.stdout) > 1  # random weights: five tokens of something, then a newline


def test_stage_run_reports_a_failed_stage(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "missing.yaml",
        {"name": "gone", "engine": "transformers", "model": str(tmp_path / "no-such-model")},
    )
    done = subprocess.run(
        [OMNI, "stage", "run", "--config", str(config), "Hello"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert "[gone] FAILED" in done.stderr and "no-such-model" in done.stderr


def test_generate_without_a_running_mesh_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [OMNI, "generate", "Hello", "--address", "127.0.0.1:1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "omni generate: 127.0.0.1:1: UNAVAILABLE" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--port", "cannot listen on 127.0.0.1:{port}"),
        ("--data-port", "cannot open the data port (runtime.data_port {port}) on 127.0.0.1"),
    ],
)
def test_a_port_in_use_is_named_not_a_traceback(flag: str, named: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = str(REPO / "examples/stages/chat.yaml")
        done = subprocess.run(
            [OMNI, "stage", "serve", "--config", config, "--port", "0", flag, str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1
    assert named.format(port=port) in done.stderr
    assert "Traceback" not in done.stderr
