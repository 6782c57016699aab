"""Stage liveness is one truth under `omni up` (issue 35): each stage of the default
pipeline (thinker, renderer, speaker), SIGKILLed idle and in the middle of a
request, is DOWN in ListStages and WatchStages within a second; the request it
held ends once, UNAVAILABLE naming it; a request sent right after the kill is not
routed to the dead address but waits for the restart (or is refused naming the
stage and its state); and once the stage is READY again, requests are served."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

from orchestrator.client import AsyncClient
from services.mesh.pb.omni.v1 import orchestrator_pb2
from tests.helpers.polling import eventually
from tests.orchestrator.cli.test_up import OMNI, REPO, read_until

READY = orchestrator_pb2.STAGE_READY
# Its first event of a request: the stage is working on it.
BUSY = {"thinker": "segment", "renderer": "progress", "speaker": "segment"}


class Watched:
    """WatchStages, recorded: (monotonic time, stage, state) of every status."""

    def __init__(self, client: AsyncClient) -> None:
        self.seen: list[tuple[float, str, int]] = []
        self._task = asyncio.create_task(self._watch(client))

    async def _watch(self, client: AsyncClient) -> None:
        async for status in client.watch_stages():
            self.seen.append((time.monotonic(), status.name, status.state))

    def first_not_ready(self, stage: str, since: float) -> float | None:
        return next(
            (t for t, s, st in self.seen if s == stage and t >= since and st != READY), None
        )

    def stop(self) -> None:
        self._task.cancel()


def stage_process(up_pid: int, stage: str) -> psutil.Process:
    return next(
        p
        for p in psutil.Process(up_pid).children(recursive=True)
        if f"{stage}.yaml" in " ".join(p.cmdline())
    )


async def kill(client: AsyncClient, watched: Watched, up_pid: int, stage: str, busy: bool) -> None:
    held: list[orchestrator_pb2.GenerateEvent] = []
    events = None
    if busy:
        events = aiter(client.generate("Tell me about rivers.", params={"max_tokens": 48}))
        while not any(e.stage == stage and e.WhichOneof("kind") == BUSY[stage] for e in held):
            held.append(await anext(events))
    victim = stage_process(up_pid, stage)
    victim.kill()
    killed = time.monotonic()

    async def not_ready() -> bool:
        states = {s.name: s.state for s in await client.list_stages()}
        return states[stage] != READY

    await eventually(not_ready, 10, interval=0.02)
    listed = time.monotonic() - killed
    # A request while the stage is down (a client retrying, say).
    after = asyncio.create_task(client.generate("Hi", params={"max_tokens": 4}).collect())
    watched_at = await eventually(lambda: watched.first_not_ready(stage, killed), 10)
    assert listed < 1.0, f"{stage}: ListStages said READY {listed:.2f}s after the kill"
    assert watched_at - killed < 1.0, f"{stage}: WatchStages {watched_at - killed:.2f}s"
    if events is not None:
        held += [event async for event in events]
        (done,) = [e.done for e in held if e.WhichOneof("kind") == "done"]
        assert done.code_name == "UNAVAILABLE" and done.stage == stage, done
        assert f"stage {stage}" in done.message
    # Not routed to the dead stage: it waited for the restart (runtime.ready_wait_s).
    served = await asyncio.wait_for(after, 180)
    assert served.ok, served.done
    await client.wait_ready(timeout_s=180)
    again = await client.generate("Hi", params={"max_tokens": 4}).collect()
    assert again.ok, again.done
    assert set(again.stages) == {"thinker", "renderer", "speaker"}


@dataclass
class Up:
    process: asyncio.subprocess.Process
    address: str


@pytest.fixture(scope="module")
async def up(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Up]:
    """The default pipeline, with time enough for a stage to restart on a busy machine."""
    folder = tmp_path_factory.mktemp("liveness")
    pipeline = yaml.safe_load((REPO / "examples/pipelines/default.yaml").read_text())
    for stage in pipeline["stages"]:
        stage["launch"] = str(REPO / "examples/pipelines" / stage["launch"])
    pipeline["runtime"] = {"ready_wait_s": 150}
    (folder / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    process = await asyncio.create_subprocess_exec(
        OMNI,
        "up",
        str(folder / "pipeline.yaml"),
        "--port",
        "0",
        "--run-dir",
        str(folder / "run"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "OMNI_CACHE_DIR": str(omni_cache_dir)},
    )
    try:
        assert process.stdout is not None
        ready = await read_until(process.stdout, "ready in", 240)
        yield Up(process, ready.rsplit(" ", 1)[1])
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 60)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_each_stage_killed_idle_and_busy_is_down_at_once_and_served_after(up: Up) -> None:
    async with AsyncClient(up.address) as client:
        watched = Watched(client)
        try:
            for stage in ("thinker", "renderer", "speaker"):
                for busy in (False, True):
                    await kill(client, watched, up.process.pid, stage, busy)
        finally:
            watched.stop()


@pytest.mark.slow
async def test_a_killed_omni_up_takes_its_stages_with_it_within_3s(up: Up) -> None:
    stages = psutil.Process(up.process.pid).children(recursive=True)
    assert len(stages) == 4  # thinker, renderer, speaker, recogniser
    async with AsyncClient(up.address) as client:
        busy = client.generate("Write at length.", params={"max_tokens": 300})
        events = aiter(busy)
        await anext(events)  # the thinker is working
        up.process.kill()
        killed = time.monotonic()

        def alive(process: psutil.Process) -> bool:
            try:
                return process.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        def all_gone() -> bool:
            return not any(alive(p) for p in stages)

        await eventually(all_gone, 10, interval=0.02)
        assert time.monotonic() - killed < 3.0
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in events:
                pass
