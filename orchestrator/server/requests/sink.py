"""The bounded buffer between a request's stages and its client.

Above ``high`` pending events, producers wait (so the request's flow stops
taking its stages' outputs and its credit holds them, request by request), except
that a new preview replaces a pending preview of the same stage and request:
previews may be coalesced, every other event is delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from services.mesh.pb.omni.v1 import orchestrator_pb2


class EventSink:
    """One reader (the client's RPC), any number of writers (one request's flow;
    every request of a GenerateStream). Two events, not a Condition: an event
    that finds room and a reader that finds one waiting take no lock and make no
    future, and this is on the way of every event a client gets."""

    def __init__(
        self, high: int = 256, low: int = 64, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        if not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high, got low={low} high={high}")
        self._high = high
        self._low = low
        self._events: deque[orchestrator_pb2.GenerateEvent] = deque()
        self._readable = asyncio.Event()  # set while events wait (or once closed)
        self._room = asyncio.Event()  # set while writers may add (at or under low)
        self._room.set()
        self._closed = False
        self.blocked_s = 0.0
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._events)

    async def put(self, event: orchestrator_pb2.GenerateEvent) -> None:
        if len(self._events) >= self._high:
            if event.WhichOneof("kind") == "progress" and self._replace_preview(event):
                return
            began = self._clock()
            self._room.clear()
            await self._room.wait()
            self.blocked_s += self._clock() - began
        self._events.append(event)
        self._readable.set()

    def _replace_preview(self, event: orchestrator_pb2.GenerateEvent) -> bool:
        key = (event.stage, event.progress.request_id)
        for index in range(len(self._events) - 1, -1, -1):
            pending = self._events[index]
            if (
                pending.WhichOneof("kind") == "progress"
                and (
                    pending.stage,
                    pending.progress.request_id,
                )
                == key
            ):
                self._events[index] = event
                self.coalesced += 1
                return True
        return False

    async def get(self) -> orchestrator_pb2.GenerateEvent | None:
        """The next event; None once closed and drained."""
        while not self._events:
            if self._closed:
                return None
            self._readable.clear()
            await self._readable.wait()
        event = self._events.popleft()
        if len(self._events) <= self._low:
            self._room.set()
        return event

    async def close(self) -> None:
        self._closed = True
        self._readable.set()
        self._room.set()
