"""One request's deliveries, from the model thread to the event loop awaiting them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.engines.base import EngineEvent, FinishOutput
from services.engines.scheduler.contract import Delivery
from services.engines.scheduler.loop_post import loop_post


class Inbox:
    """Create it on the event loop. ``deliver`` is the request's ``deliver`` (called on
    the model thread; a step's deliveries share one wake of the loop, LoopPost);
    ``events`` yields them on the loop, raises an error delivered instead, and ends
    after the request's FinishOutput."""

    def __init__(self) -> None:
        self._post = loop_post(asyncio.get_running_loop())
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()

    def deliver(self, delivery: Delivery) -> None:
        self._post.post(self._queue.put_nowait, delivery)

    async def events(self) -> AsyncIterator[EngineEvent]:
        while True:
            delivery = await self._queue.get()
            if isinstance(delivery, BaseException):
                raise delivery
            for event in delivery:
                yield event
                if isinstance(event, FinishOutput):
                    return
