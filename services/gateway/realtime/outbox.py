"""A session's server events on their way to the client: serialised once, queued
in order, written by one task. What the client has not read is bounded
(``max_unread_bytes``): a client that stops reading fills it, the session is
told it is too slow, and nothing more is queued, so a stalled reader costs the
gateway that much memory and no more."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from typing import Any

import orjson
from starlette.websockets import WebSocket

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, websocket: WebSocket, max_unread_bytes: int) -> None:
        self._websocket = websocket
        self._limit = max_unread_bytes
        self._queue: collections.deque[str] = collections.deque()
        self._queued_bytes = 0
        self._ready = asyncio.Event()
        self._empty = asyncio.Event()  # everything queued has been sent
        self._empty.set()
        self.overflowed = asyncio.Event()  # the client stopped reading

    def put(self, event: dict[str, Any], *, last: bool = False) -> None:
        """Queue ``event`` (its ``event_id`` added); dropped once overflowed, but
        for the ``last`` one, which says why the session ends."""
        if self.overflowed.is_set() and not last:
            return
        text = orjson.dumps({"event_id": f"event_{uuid.uuid4().hex[:20]}", **event}).decode()
        self._queued_bytes += len(text)
        if self._queued_bytes > self._limit and not last:
            self._queued_bytes -= len(text)
            self.overflowed.set()  # the session ends: what is queued stays as it is
            return
        self._queue.append(text)
        self._empty.clear()
        self._ready.set()

    async def write(self) -> None:
        """Send what is queued, in order, until cancelled (the session's writer task)."""
        while True:
            await self._ready.wait()
            while self._queue:
                text = self._queue[0]
                await self._websocket.send_text(text)
                self._queue.popleft()
                self._queued_bytes -= len(text)
            self._ready.clear()
            self._empty.set()

    def discard(self) -> None:
        """Drop what is queued (the writer stopped: the client no longer reads)."""
        self._queue.clear()
        self._queued_bytes = 0
        self._empty.set()

    async def flush_one(self, websocket: WebSocket) -> None:
        """Send the first queued event here, without the writer (it is stopped)."""
        if self._queue:
            await websocket.send_text(self._queue.popleft())

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until what is queued has been sent."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._empty.wait()
