"""Who hears of one stage's status: callbacks run on the event loop with every
published status, and ``follow()`` readers, each with a bounded queue that keeps
the newest statuses (a slow reader misses old ones, never the latest)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable

from services.mesh.pb.omni.v1 import orchestrator_pb2

logger = logging.getLogger(__name__)

Status = orchestrator_pb2.StageStatus


class StatusFeed:
    def __init__(self, stage: str) -> None:
        self._stage = stage
        self._callbacks: list[Callable[[Status], None]] = []
        self._readers: set[_Reader] = set()
        self._closed = False

    def on_change(self, callback: Callable[[Status], None]) -> None:
        self._callbacks.append(callback)

    async def follow(self, current: Status) -> AsyncIterator[Status]:
        """``current``, then every status published until the feed closes."""
        reader = _Reader()
        self._readers.add(reader)
        try:
            yield current
            if self._closed:
                return
            while (status := await reader.get()) is not None:
                yield status
        finally:
            self._readers.discard(reader)

    def publish(self, status: Status) -> None:
        for reader in self._readers:
            reader.put(status)
        for callback in self._callbacks:
            try:
                callback(status)
            except Exception:  # one bad observer must not stop the watching
                logger.exception("stage %s: on_change callback failed", self._stage)

    def close(self) -> None:
        """No more statuses: every reader's ``follow()`` ends."""
        self._closed = True
        for reader in self._readers:
            reader.close()


class _Reader:
    """One follow() reader: a bounded queue that keeps the newest statuses."""

    def __init__(self, keep: int = 256) -> None:
        self._queue: collections.deque[Status | None] = collections.deque(maxlen=keep)
        self._ready = asyncio.Event()

    def put(self, status: Status) -> None:
        self._queue.append(status)
        self._ready.set()

    def close(self) -> None:
        self._queue.append(None)
        self._ready.set()

    async def get(self) -> Status | None:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()
