"""Admission: up to ``max_active`` requests run, up to ``max_queued`` wait in
FIFO order, and anything beyond is refused at once with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from services.mesh.errors import ResourceExhausted


class Admission:
    def __init__(self, max_active: int, max_queued: int) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_active)
        self.active = 0
        self.queued = 0

    @asynccontextmanager
    async def slot(self, request_id: str) -> AsyncIterator[None]:
        """Hold a run slot for the body; a cancelled waiter leaves the queue."""
        await self.wait_turn(request_id)
        try:
            yield
        finally:
            self.leave()

    async def wait_turn(self, request_id: str) -> None:
        """Queue for a run slot and take it (``leave`` gives it back); refused at once
        when the queue is full; a cancelled waiter leaves the queue."""
        if self.active + self.queued >= self.max_active + self.max_queued:
            raise ResourceExhausted(
                f"request {request_id}: stage is full ({self.active} running, "
                f"{self.queued} queued, max_queue_size {self.max_queued})",
                field="request_id",
            )
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        self._slots.release()
