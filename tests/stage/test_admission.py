from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from services.mesh.errors import ResourceExhausted
from services.stage.serving.admission import Admission


async def settled(condition: Callable[[], bool], turns: int = 100) -> None:
    """Let the loop run the tasks until ``condition`` holds (no wall-clock wait)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the tasks never got there")


async def test_runs_up_to_max_active_then_queues_then_refuses() -> None:
    admission = Admission(max_active=1, max_queued=1)
    release = asyncio.Event()
    order: list[str] = []

    async def job(name: str) -> None:
        async with admission.slot(name):
            order.append(name)
            await release.wait()

    first = asyncio.create_task(job("a"))
    second = asyncio.create_task(job("b"))
    await settled(lambda: admission.queued == 1)
    assert (admission.active, admission.queued) == (1, 1)
    with pytest.raises(ResourceExhausted) as refused:
        async with admission.slot("c"):
            pass
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue_size 1" in refused.value.message
    release.set()
    await asyncio.gather(first, second)
    assert order == ["a", "b"]
    assert (admission.active, admission.queued) == (0, 0)


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    admission = Admission(max_active=1, max_queued=4)
    hold = asyncio.Event()

    async def job() -> None:
        async with admission.slot("x"):
            await hold.wait()

    running = asyncio.create_task(job())
    waiting = asyncio.create_task(job())
    await settled(lambda: admission.queued == 1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert admission.queued == 0
    hold.set()
    await running
    assert admission.active == 0
