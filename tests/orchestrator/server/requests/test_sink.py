from __future__ import annotations

import asyncio

import pytest

from orchestrator.server.requests.sink import EventSink
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2


def segment(seq: int) -> orchestrator_pb2.GenerateEvent:
    return orchestrator_pb2.GenerateEvent(
        stage="a", segment=stage_pb2.Segment(request_id="r", sequence=seq)
    )


def progress(step: int, stage: str = "a") -> orchestrator_pb2.GenerateEvent:
    return orchestrator_pb2.GenerateEvent(
        stage=stage, progress=stage_pb2.Progress(request_id="r", step=step)
    )


async def test_events_come_out_in_order_and_end_after_close() -> None:
    sink = EventSink(high=10, low=2)
    for i in range(3):
        await sink.put(segment(i))
    await sink.close()
    got = []
    while (event := await sink.get()) is not None:
        got.append(event.segment.sequence)
    assert got == [0, 1, 2]


async def settle() -> None:
    """Let every ready task run until it waits (no wall-clock time involved)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_above_high_producers_wait_until_below_low() -> None:
    now = [0.0]
    sink = EventSink(high=3, low=1, clock=lambda: now[0])
    for i in range(3):
        await sink.put(segment(i))
    blocked = asyncio.create_task(sink.put(segment(3)))
    await settle()
    assert not blocked.done()
    now[0] = 2.5
    await sink.get()  # 2 left: still above low
    await settle()
    assert not blocked.done()
    await sink.get()  # 1 left: at low, the producer goes on
    await asyncio.wait_for(blocked, 1)
    assert sink.blocked_s == 2.5
    assert [(await sink.get()).segment.sequence for _ in range(2)] == [2, 3]


async def test_previews_coalesce_when_full_but_segments_never_drop() -> None:
    sink = EventSink(high=2, low=0)
    await sink.put(progress(1))
    await sink.put(segment(0))
    await asyncio.wait_for(sink.put(progress(2)), 1)  # replaces step 1 instead of waiting
    assert sink.coalesced == 1 and len(sink) == 2
    assert (await sink.get()).progress.step == 2
    assert (await sink.get()).segment.sequence == 0


def test_watermarks_must_make_sense() -> None:
    with pytest.raises(ValueError, match="low < high"):
        EventSink(high=2, low=2)


async def test_close_wakes_the_reader_and_every_waiting_producer() -> None:
    sink = EventSink(high=1, low=0)
    reader = asyncio.create_task(sink.get())
    await settle()
    assert not reader.done()  # nothing yet: it waits
    await sink.put(segment(0))
    assert (await asyncio.wait_for(reader, 1)).segment.sequence == 0
    await sink.put(segment(1))
    waiting = [asyncio.create_task(sink.put(segment(i))) for i in (2, 3)]
    await settle()
    assert not any(task.done() for task in waiting)
    await sink.close()
    await asyncio.wait_for(asyncio.gather(*waiting), 1)  # nobody is left hanging
    assert [(await sink.get()).segment.sequence for _ in range(3)] == [1, 2, 3]
    assert await sink.get() is None
