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
    def __init__(
        self, high: int = 256, low: int = 64, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        if not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high, got low={low} high={high}")
        self._high = high
        self._low = low
        self._events: deque[orchestrator_pb2.GenerateEvent] = deque()
        self._changed = asyncio.Condition()
        self._closed = False
        self.blocked_s = 0.0
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._events)

    async def put(self, event: orchestrator_pb2.GenerateEvent) -> None:
        async with self._changed:
            if len(self._events) >= self._high:
                if event.WhichOneof("kind") == "progress" and self._replace_preview(event):
                    return
                began = self._clock()
                await self._changed.wait_for(lambda: len(self._events) <= self._low or self._closed)
                self.blocked_s += self._clock() - began
            self._events.append(event)
            self._changed.notify_all()

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
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._events) or self._closed)
            if not self._events:
                return None
            event = self._events.popleft()
            self._changed.notify_all()
            return event

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()
