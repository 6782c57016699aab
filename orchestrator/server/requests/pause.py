"""``PauseGeneration``'s hold on new requests: while paused, a request waits
before its first stage, but never past ``max_pause_s`` from the pause, so a mesh
paused and forgotten answers UNAVAILABLE rather than holding requests forever."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from orchestrator.server.requests.errors import NotStarted
from services.mesh.errors import Unavailable


class Pause:
    def __init__(self, max_pause_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_pause_s = max_pause_s
        self._clock = clock
        self._paused_at: float | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.held = 0  # requests waiting for ResumeGeneration now

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = self._clock()
        self._resumed.clear()

    def resume(self) -> None:
        self._paused_at = None
        self._resumed.set()

    async def wait(self) -> None:
        """Return once generation is resumed; NotStarted (UNAVAILABLE) past max_pause_s."""
        if self._paused_at is None:
            return
        self.held += 1
        try:
            while self._paused_at is not None:
                left = self._paused_at + self._max_pause_s - self._clock()
                if left <= 0:
                    raise NotStarted(
                        "",
                        Unavailable(
                            f"generation is paused (for over max_pause_s={self._max_pause_s:g}s)"
                        ),
                    )
                try:
                    async with asyncio.timeout(left):
                        await self._resumed.wait()
                except TimeoutError:
                    continue
        finally:
            self.held -= 1
