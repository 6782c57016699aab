"""One request's deliveries, from the model thread to the event loop awaiting them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.engines.base import EngineEvent, FinishOutput
from services.engines.scheduler.contract import Delivery, Windowed, WindowEnd
from services.engines.scheduler.loop_post import loop_post


class Inbox:
    """Create it on the event loop. ``deliver`` is the request's ``deliver`` (called on
    the model thread; a step's deliveries share one wake of the loop, LoopPost);
    ``events`` yields them on the loop, raises an error delivered instead, and ends
    after the request's FinishOutput (``finished`` from then on). A request fed window
    by window reads each window's events with ``window``, the same inbox throughout."""

    def __init__(self) -> None:
        self._post = loop_post(asyncio.get_running_loop())
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.finished = False

    def deliver(self, delivery: Delivery) -> None:
        self._post.post(self._queue.put_nowait, delivery)

    def events(self) -> AsyncIterator[EngineEvent]:
        """Every event to the request's end."""
        return self._read(None)

    def window(self, request: Windowed) -> AsyncIterator[EngineEvent]:
        """The events of the input ``request`` has been given: they end where it has
        used all of it (a WindowEnd counting all it was given; or at once, when it waits
        for input and nothing is left to read), or at its end. An earlier window's
        WindowEnd (more input came meanwhile) is passed over."""
        return self._read(request)

    async def _read(self, window: Windowed | None) -> AsyncIterator[EngineEvent]:
        while not self.finished:
            if window is not None and not window.ready and self._queue.empty():
                return  # it waits for more input: this window's events are all out
            delivery = await self._queue.get()
            if isinstance(delivery, BaseException):
                raise delivery
            for event in delivery:
                if isinstance(event, WindowEnd):
                    if window is not None and event.given == window.given:
                        return  # every input this window brought is used
                    continue
                yield event
                if isinstance(event, FinishOutput):
                    self.finished = True
                    return
