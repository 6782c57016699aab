"""SIGTERM during a model download: the stage stops within drain_grace_s and
the bytes so far stay in a partial file that the next start resumes."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.startup.fetch import fetch_model
from services.testing.configs import write_config
from tests.helpers.http_server import FileServer

ROOT = Path(__file__).resolve().parents[4]
SIZE = 8 << 20
GRACE_S = 10.0  # the download alone would take 30 s (slow) or forever (silent)


class NoHook:
    def start(self, source: str, bytes_total: int | None) -> None: ...
    def progress(self, bytes_done: int, bytes_total: int | None) -> None: ...
    def done(self, result: object, duration_s: float) -> None: ...
    def preparing(self, what: str) -> None: ...


@pytest.mark.slow
@pytest.mark.parametrize(
    "server_options",
    [{"rate_bps": 256_000}, {"rate_bps": 256_000, "hang_after": 100_000}],
    ids=["slow-server", "silent-server"],
)
async def test_sigterm_during_a_download_stops_the_stage_and_keeps_the_partial(
    tmp_path: Path, server_options: dict[str, int]
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "model.bin").write_bytes(os.urandom(SIZE))
    cache = tmp_path / "cache"
    with FileServer(site, **server_options) as server:  # type: ignore[arg-type]
        config = {
            "name": "fetcher",
            "engine": "tests.helpers.engines:ScriptedEngine",
            "model": server.url("model.bin"),
            "cache_dir": str(cache),
            "runtime": {"drain_grace_s": GRACE_S, "download_stall_timeout_s": 60},
        }
        stage = StageProcess(
            write_config(tmp_path / "fetcher.yaml", config), env={"PYTHONPATH": str(ROOT)}
        )
        await stage.start()
        try:
            async with StageClient(stage.address) as client:
                async for event in client.init_events():
                    if event.phase == stage_pb2.DOWNLOAD_PROGRESS and event.bytes_done > 0:
                        break
            if server.hang_after is not None:  # SIGTERM while a read waits on a silent server
                assert await asyncio.to_thread(server.hanging.wait, 30)
            began = time.monotonic()
            code = await stage.stop(grace_s=30)
            took = time.monotonic() - began
        finally:
            await stage.stop(1)
        (partial,) = (cache / "downloads").glob("*.partial")
        kept = partial.stat().st_size
        assert code == 0 and took < GRACE_S, f"exit {code} after {took:.1f}s"
        assert 0 < kept < SIZE
        # The next start resumes where this one stopped.
        server.rate_bps = server.hang_after = None
        result = await asyncio.to_thread(
            fetch_model, server.url("model.bin"), cache, NoHook(), stall_timeout_s=10
        )
        assert server.ranges == [f"bytes={kept}-"]
    assert result.path.read_bytes() == (site / "model.bin").read_bytes()
