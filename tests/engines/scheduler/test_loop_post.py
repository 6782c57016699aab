"""LoopPost (services/engines/loop_post.py) hands a model thread's items to an event
loop in order, with one wake for the items posted before the loop gets to them: by
an eventfd written while holding the GIL (Linux), or call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import services.engines.scheduler.loop_post as module
from services.engines.scheduler.loop_post import LoopPost, loop_post


@pytest.fixture(params=["eventfd", "call_soon_threadsafe"])
def wake(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "eventfd":
        if module._WRITE is None:
            pytest.skip("no eventfd here")
    else:
        monkeypatch.setattr(module, "_WRITE", None)
    return str(request.param)


async def test_items_arrive_in_order_and_a_burst_costs_one_wake(
    wake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = asyncio.get_running_loop()
    drains = 0
    real = LoopPost._drain

    def counted(self: LoopPost) -> None:
        nonlocal drains
        drains += 1
        real(self)

    monkeypatch.setattr(LoopPost, "_drain", counted)
    post = LoopPost(loop)
    assert (post._fd is not None) == (wake == "eventfd")
    first: asyncio.Queue[int] = asyncio.Queue()
    second: asyncio.Queue[int] = asyncio.Queue()
    posted = threading.Event()

    def burst() -> None:  # a model thread's step: 50 items for two requests
        for item in range(50):
            post.post((first if item % 2 else second).put_nowait, item)
        posted.set()

    # The loop is busy while the thread posts (as it is while a step's tokens leave).
    loop.call_soon(lambda: (threading.Thread(target=burst).start(), posted.wait(10)))
    got_first = [await asyncio.wait_for(first.get(), 10) for _ in range(25)]
    got_second = [await asyncio.wait_for(second.get(), 10) for _ in range(25)]
    assert got_first == list(range(1, 50, 2))
    assert got_second == list(range(0, 50, 2))
    assert drains == 1

    # Items posted after the loop drained wake it again.
    later = threading.Thread(target=post.post, args=(first.put_nowait, 99))
    later.start()
    later.join()
    assert await asyncio.wait_for(first.get(), 10) == 99
    assert drains == 2


async def test_one_post_per_loop() -> None:
    loop = asyncio.get_running_loop()
    assert loop_post(loop) is loop_post(loop)


def test_posting_to_a_closed_loop_is_dropped_quietly(wake: str) -> None:
    loop = asyncio.new_event_loop()
    post = LoopPost(loop)
    loop.close()
    received: list[int] = []
    post.post(received.append, 1)  # no one is listening: no error
    time.sleep(0.01)
    assert received == [] and post._pending == []
