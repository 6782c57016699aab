"""A request's inbox (scheduler/inbox.py), fed from another thread as the model thread
feeds it: ``events`` reads a request whole, to its FinishOutput; ``window`` reads the
events of the input a request fed window by window has been given, ending at the
WindowEnd that counts all of it (an earlier window's is passed over), or at once when
the request waits for input with nothing left to read."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from services.engines.base import EngineEvent, FinishOutput, TokenOutput
from services.engines.scheduler import Delivery, Inbox, WindowEnd


@dataclass
class Fed:
    """A request fed window by window: ``given`` rows, ``ready`` while it has a row
    for its next step."""

    given: int = 0
    used: int = 0

    @property
    def ready(self) -> bool:
        return self.used < self.given


def token(n: int) -> TokenOutput:
    return TokenOutput((n,), str(n))


async def from_thread(inbox: Inbox, *deliveries: Delivery) -> None:
    """Deliver as the model thread does, from a thread of its own; the loop takes them
    in at its next turn (LoopPost)."""

    def model_thread() -> None:
        for delivery in deliveries:
            inbox.deliver(delivery)

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    await asyncio.sleep(0.01)


async def read(stream: object) -> list[EngineEvent]:
    async def drain() -> list[EngineEvent]:
        return [event async for event in stream]  # type: ignore[attr-defined]

    return await asyncio.wait_for(drain(), timeout=10)


async def test_a_request_read_whole_ends_after_its_finish_and_passes_window_ends_over() -> None:
    inbox = Inbox()
    finish = FinishOutput("length", 3, 3)
    await from_thread(inbox, [token(0), WindowEnd(1)], [token(1)], [token(2), finish])
    assert await read(inbox.events()) == [token(0), token(1), token(2), finish]
    assert inbox.finished
    assert await read(inbox.events()) == []  # nothing after the end


async def test_each_window_ends_where_its_input_is_used() -> None:
    inbox, request = Inbox(), Fed(given=2)
    request.used = 2  # the model thread used both rows, and says so after the step
    await from_thread(inbox, [token(0)], [token(1), WindowEnd(2)])
    assert await read(inbox.window(request)) == [token(0), token(1)]
    # The next window brings two rows; its steps come, with their WindowEnd.
    request.given = 4
    await from_thread(inbox, [token(2)], [token(3), WindowEnd(4)])
    request.used = 4
    assert await read(inbox.window(request)) == [token(2), token(3)]
    assert not inbox.finished


async def test_an_earlier_windows_end_is_passed_over_when_more_input_came() -> None:
    """The next window's rows arrived while this window was read: its WindowEnd (2)
    is stale, and this window reads on to the end of all it was given (3)."""
    inbox, request = Inbox(), Fed(given=3, used=3)
    await from_thread(inbox, [token(0), WindowEnd(2)], [token(1), WindowEnd(3)], [token(9)])
    assert await read(inbox.window(request)) == [token(0), token(1)]
    # The next window finds the request waiting and nothing read for it but what is
    # queued: that, then it ends at once.
    assert await read(inbox.window(request)) == [token(9)]
    assert await read(inbox.window(request)) == []


async def test_the_last_window_runs_to_the_finish_and_an_error_is_raised() -> None:
    inbox, request = Inbox(), Fed(given=1, used=1)
    finish = FinishOutput("eos", 1, 2)
    await from_thread(inbox, [token(0), WindowEnd(1)], [token(1), finish])
    assert await read(inbox.events()) == [token(0), token(1), finish]
    assert await read(inbox.window(request)) == []  # finished: nothing more, no wait
    failing = Inbox()
    await from_thread(failing, [token(0)], RuntimeError("the forward failed"))
    with pytest.raises(RuntimeError, match="the forward failed"):
        await read(failing.events())
