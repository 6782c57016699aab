from __future__ import annotations

import asyncio

from orchestrator.server.pipeline import Edge
from orchestrator.server.requests.lanes import Lane
from orchestrator.server.requests.windows import Window


def window(seq: int, tokens: int) -> Window:
    return Window(seq, False, tuple(range(tokens)), "", (), ())


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    """Let every ready task run until it waits (no wall-clock time involved)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_upstream_waits_above_high_until_downstream_takes_it_to_low() -> None:
    clock = Clock()
    lane = Lane(
        Edge.model_validate(
            {"from": "a", "to": "b", "window": 2, "high_watermark": 4, "low_watermark": 1}
        ),
        clock,
    )
    await lane.put([window(0, 2), window(1, 2)])  # 4 in flight: at the mark, no wait
    assert lane.in_flight == 4
    reader = asyncio.create_task(lane.put([window(2, 2)]))  # 6 > 4: the reader waits
    await settle()
    assert not reader.done()
    clock.now = 5.0
    lane.taken(await lane.take())  # 4 left: still above low
    await settle()
    assert not reader.done()
    lane.taken(await lane.take())
    lane.taken(await lane.take())  # 0 <= 1: the reader goes on
    await asyncio.wait_for(reader, 1)
    assert lane.blocked_s == 5.0 and lane.in_flight == 0


async def test_windows_come_out_in_order_then_the_end() -> None:
    lane = Lane(Edge.model_validate({"from": "a", "to": "b"}))
    await lane.put([window(0, 1), window(1, 3)])
    lane.close()
    got = []
    while (w := await lane.take()) is not None:
        got.append(w.sequence)
        lane.taken(w)
    assert got == [0, 1] and lane.in_flight == 0


async def test_a_tensor_only_window_counts_as_one_item() -> None:
    lane = Lane(
        Edge.model_validate({"from": "a", "to": "b", "high_watermark": 1, "low_watermark": 0})
    )
    await lane.put([window(0, 0)])
    assert lane.in_flight == 1
