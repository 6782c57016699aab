"""One edge of one request: the windows read from upstream and not yet handed
to the downstream stage's stream, with the edge's watermarks.

Above ``high`` items in flight the upstream reader waits until the downstream
writer has taken the count back to ``low``; while it waits it takes nothing of
the request's upstream outputs and grants no credit, so the upstream stage
pauses this request (and only it) once its credit is spent.
Only windows already complete count: a full-trigger edge (window -1) holds its
items in the window state, not here, and can never wait on itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from orchestrator.server.pipeline import Edge
from orchestrator.server.requests.windows import Window, WindowState


def items(window: Window) -> int:
    return max(len(window.token_ids), 1)


class Lane:
    def __init__(self, edge: Edge, clock: Callable[[], float] = time.monotonic) -> None:
        self.edge = edge
        self.windows = WindowState(edge.window, edge.first_window)
        self._outbox: asyncio.Queue[Window | None] = asyncio.Queue()
        self._clock = clock
        self._below_low = asyncio.Event()
        self._below_low.set()
        self.in_flight = 0
        self.blocked_s = 0.0

    async def put(self, windows: list[Window]) -> None:
        """Queue complete windows for downstream; wait while above the high mark."""
        for window in windows:
            self.in_flight += items(window)
            self._outbox.put_nowait(window)
        if self.in_flight > self.edge.high_watermark:
            self._below_low.clear()
            began = self._clock()
            await self._below_low.wait()
            self.blocked_s += self._clock() - began

    def close(self) -> None:
        self._outbox.put_nowait(None)

    async def take(self) -> Window | None:
        """The next window for downstream (None: upstream is done)."""
        return await self._outbox.get()

    def taken(self, window: Window) -> None:
        """``window`` is in the downstream stream now."""
        self.in_flight -= items(window)
        if self.in_flight <= self.edge.low_watermark:
            self._below_low.set()
