"""The gate a request passes before it is routed: it waits (bounded) for a stage
that is DOWN or restarting, goes as soon as the stage is READY and described, and
refuses naming the stage and its state when a stage FAILED or the wait is over."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.server.requests.errors import NotStarted
from orchestrator.server.requests.gate import StageGate
from services.mesh.pb.omni.v1 import orchestrator_pb2

Status = orchestrator_pb2.StageStatus


class Stage:
    """A stage's status as its monitor would give it."""

    def __init__(self, state: int, message: str = "") -> None:
        self.status = Status(state=state, message=message)


async def test_a_request_waits_for_a_restarting_stage_and_goes_once_ready() -> None:
    renderer = Stage(orchestrator_pb2.STAGE_DOWN, "its process exited (killed by signal 9)")
    described: set[str] = {"thinker"}
    gate = StageGate(
        {"thinker": Stage(orchestrator_pb2.STAGE_READY), "renderer": renderer}, described, 30
    )
    waiting = asyncio.create_task(gate.until_ready(["thinker", "renderer"], None))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    renderer.status = Status(state=orchestrator_pb2.STAGE_READY)
    gate.changed()
    await asyncio.sleep(0.05)
    assert not waiting.done()  # READY, but its Describe has not come: not routed yet
    described.add("renderer")
    gate.changed()
    await asyncio.wait_for(waiting, 1)


async def test_a_failed_stage_refuses_at_once_and_a_long_wait_ends() -> None:
    failed = StageGate({"s": Stage(orchestrator_pb2.STAGE_FAILED, "init timed out")}, {"s"}, 30)
    began = time.monotonic()
    with pytest.raises(NotStarted) as refused:
        await failed.until_ready(["s"], None)
    assert time.monotonic() - began < 0.5
    assert refused.value.stage == "s" and refused.value.code.name == "UNAVAILABLE"
    assert refused.value.message == "stage s is not ready: STAGE_FAILED (init timed out)"
    stages = {"s": Stage(orchestrator_pb2.STAGE_DOWN, "not answering")}
    down = StageGate(stages, {"s"}, 0.3)
    with pytest.raises(NotStarted) as waited:
        await down.until_ready(["s"], None)
    assert "after waiting 0.3s: STAGE_DOWN (not answering)" in waited.value.message
    # The request's own deadline bounds the wait too.
    began = time.monotonic()
    with pytest.raises(NotStarted):
        await StageGate(stages, {"s"}, 30).until_ready(["s"], time.monotonic() + 0.2)
    assert time.monotonic() - began < 1.0


async def test_a_held_request_counts_for_the_stage_it_waits_for_until_it_leaves() -> None:
    """What a stage's autoscaler reads (orchestrator/server/scaling): requests held for it."""
    renderer = Stage(orchestrator_pb2.STAGE_DOWN, "no replica")
    described = {"thinker"}
    stages = {"thinker": Stage(orchestrator_pb2.STAGE_READY), "renderer": renderer}
    gate = StageGate(stages, described, 30)
    await gate.until_ready(["thinker"], None)  # passes at once, held by nothing
    both = asyncio.create_task(gate.until_ready(["thinker", "renderer"], None))
    alone = asyncio.create_task(gate.until_ready(["renderer"], None))
    short = asyncio.create_task(gate.until_ready(["renderer"], time.monotonic() + 0.1))
    await asyncio.sleep(0.05)
    # Held for the renderer, not for the thinker, which could take them now.
    assert (gate.waiting("renderer"), gate.waiting("thinker")) == (3, 0)
    with pytest.raises(NotStarted):
        await short  # refused at its deadline: no longer held
    assert gate.waiting("renderer") == 2
    renderer.status = Status(state=orchestrator_pb2.STAGE_READY)
    described.add("renderer")
    gate.changed()
    await asyncio.wait_for(asyncio.gather(both, alone), 1)
    assert gate.waiting("renderer") == 0
