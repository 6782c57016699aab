"""LoopPost (services/engines/loop_post.py) hands a model thread's items to an event
loop in order, with one wake for the items posted before the loop gets to them."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from services.engines.loop_post import loop_post


async def test_items_arrive_in_order_and_a_burst_costs_one_wake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    wakes = 0
    real = loop.call_soon_threadsafe

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal wakes
        wakes += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    post = loop_post(loop)
    assert loop_post(loop) is post  # one per loop
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
    assert wakes == 1

    # Items posted after the loop drained wake it again.
    later = threading.Thread(target=post.post, args=(first.put_nowait, 99))
    later.start()
    later.join()
    assert await asyncio.wait_for(first.get(), 10) == 99
    assert wakes == 2


def test_posting_to_a_closed_loop_is_dropped_quietly() -> None:
    loop = asyncio.new_event_loop()
    post = loop_post(loop)
    loop.close()
    received: list[int] = []
    post.post(received.append, 1)  # no one is listening: no error
    time.sleep(0.01)
    assert received == []
