"""A real mesh for /v1/realtime: a SmolLM2 thinker and a hibari speaker as stage
processes (each serving its metrics for scraping, so a test reads what a stage
holds from the stage itself), an orchestrator in the test's process, and
`omni gateway` as its own process with small limits."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from orchestrator.cli.processes import StageProcess
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import stage_config, write_config
from tests.engines.speech.conftest import speaker_config
from tests.gateway.conftest import Mesh, mesh_over
from tests.helpers.ports import free_port
from tests.orchestrator.cli.test_up import read_until

EDGE = {"from": "thinker", "to": "speaker", "window": 4, "first_window": 2, "transform": "tokens"}
LIMITS = {
    "--max-sessions": "40",
    "--max-audio-buffer-bytes": str(1 << 20),
    "--max-unread-bytes": str(1 << 20),
}


class MeteredStages:
    """Stage processes by name, each with its Prometheus port (``metrics``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: dict[str, StageProcess] = {}
        self.addresses: dict[str, str] = {}
        self.metrics_ports: dict[str, int] = {}

    async def start(self, configs: dict[str, dict]) -> None:
        for name, config in configs.items():
            port = self.metrics_ports[name] = free_port()
            env = {"OMNI_PROMETHEUS_PORT": str(port), "OMNI_PROMETHEUS_HOST": "127.0.0.1"}
            process = StageProcess(write_config(self.folder / f"{name}.yaml", config), env=env)
            self.processes[name] = process
            self.addresses[name] = await process.start()
        for address in self.addresses.values():
            async with StageClient(address) as client:
                await client.wait_ready(timeout_s=180)

    async def stop(self) -> None:
        for process in self.processes.values():
            await process.stop(5)

    async def holding(self, name: str) -> float:
        """Requests the stage holds now (running and queued), from its own metrics."""
        url = f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(url)).text
        held = 0.0
        for line in text.splitlines():
            if line.startswith(("omni_stage_running", "omni_stage_queue_depth")):
                held += float(line.rsplit(" ", 1)[1])
        return held


@pytest.fixture(scope="module")
async def metered(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[MeteredStages]:
    stages = MeteredStages(tmp_path_factory.mktemp("realtime"))
    thinker = stage_config(
        "thinker",
        omni_cache_dir,
        segmenting={"max_segment_tokens": 4, "min_flush_interval_ms": 50},
        runtime={"torch_threads": 1, "max_batch_size": 4, "max_queue_size": 64},
    )
    speaker = speaker_config(str(omni_cache_dir))
    speaker["runtime"] = {**speaker["runtime"], "max_batch_size": 4, "max_queue_size": 64}
    try:
        await stages.start({"thinker": thinker, "speaker": speaker})
        yield stages
    finally:
        await stages.stop()


@pytest.fixture(scope="module")
async def speaking(metered: MeteredStages) -> AsyncIterator[Mesh]:
    """The speech pipeline (thinker -> speaker) behind a gateway with small limits."""
    args = [item for pair in LIMITS.items() for item in pair]
    async with mesh_over(
        metered,  # type: ignore[arg-type]
        metered.folder,
        edges=[EDGE],
        outputs=["thinker", "speaker"],
        gateway_args={"args": args},
    ) as mesh:
        yield mesh


REPO = Path(__file__).resolve().parents[3]


@asynccontextmanager
async def omni_up(pipeline: str, folder: Path, cache_dir: Path, *flags: str) -> AsyncIterator[str]:
    """`omni up PIPELINE --http 0` as a user runs it; yields the gateway's base URL
    and stops it all with Ctrl-C (SIGINT) after."""
    omni = str(Path(sys.executable).parent / "omni")
    errors = folder / "omni-up.stderr"
    with errors.open("wb") as err:
        up = await asyncio.create_subprocess_exec(
            omni, "up", str(REPO / pipeline), "--port", "0", "--http", "0",
            "--run-dir", str(folder), *flags,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            env={**os.environ, "OMNI_CACHE_DIR": str(cache_dir)},
        )  # fmt: skip
    assert up.stdout is not None
    try:
        seen: list[str] = []
        try:
            await read_until(up.stdout, "ready in", 300, seen)
            line = await read_until(up.stdout, "gateway at", 60, seen)
        except AssertionError as exc:  # what omni up said, to see why
            said = "".join(seen)[-3000:] + errors.read_text()[-3000:]
            raise AssertionError(f"{exc}; it said:\n{said}") from None
        yield line.split()[2]
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(up.wait(), 60)
            except TimeoutError:
                up.kill()
                await up.wait()


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def default(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[str]:
    """`omni up examples/pipelines/default.yaml --http 0 --max-sessions 3`: its
    gateway's base URL, shared by the modules that test the default pipeline."""
    folder = tmp_path_factory.mktemp("default-up")
    pipeline = "examples/pipelines/default.yaml"
    async with omni_up(pipeline, folder, omni_cache_dir, "--max-sessions", "3") as base_url:
        yield base_url
