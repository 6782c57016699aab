"""The init-phase bus: every start-up step is published here once, and each
InitStatus stream replays the history and then follows live events.

``publish`` may be called from any thread (model fetch and load run in worker
threads); followers live on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from services.mesh.pb.omni.v1 import stage_pb2

logger = logging.getLogger(__name__)

Phase = stage_pb2.InitPhase
TERMINAL = frozenset({stage_pb2.READY, stage_pb2.FAILED})


class InitBus:
    def __init__(
        self,
        stage: str,
        loop: asyncio.AbstractEventLoop,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.stage = stage
        self._loop = loop
        self._clock = clock
        self._wall_clock = wall_clock
        self._origin = clock()
        self._events: list[stage_pb2.InitEvent] = []
        self.compute = ""  # how the loaded engine computes (ModelInfo.compute): Describe
        self._lock = threading.Lock()
        self._changed = asyncio.Event()

    @property
    def phase(self) -> int:
        with self._lock:
            return self._events[-1].phase if self._events else stage_pb2.INIT_PHASE_UNSPECIFIED

    @property
    def events(self) -> list[stage_pb2.InitEvent]:
        with self._lock:
            return list(self._events)

    def elapsed(self) -> float:
        return self._clock() - self._origin

    def publish(self, phase: int, **fields: object) -> stage_pb2.InitEvent:
        event = stage_pb2.InitEvent(stage=self.stage, phase=phase, **fields)  # type: ignore[arg-type]
        event.wall_time.FromNanoseconds(int(self._wall_clock() * 1e9))
        event.monotonic_s = self.elapsed()
        with self._lock:
            self._events.append(event)
        if phase != stage_pb2.DOWNLOAD_PROGRESS:
            logger.info(
                "stage %s: %s %s", self.stage, Phase.Name(phase), event.message or event.reason
            )
        self._loop.call_soon_threadsafe(self._wake)
        return event

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self) -> AsyncIterator[stage_pb2.InitEvent]:
        """Every event since start, then live ones; ends after READY or FAILED.

        A stage whose engine died after READY publishes FAILED: a follower
        that comes later gets READY and then that FAILED, its state now."""
        sent = 0
        while True:
            waiter = self._changed
            with self._lock:
                history = list(self._events)
            for index in range(sent, len(history)):
                event = history[index]
                yield event
                if event.phase == stage_pb2.READY:
                    later = [e for e in history[index + 1 :] if e.phase == stage_pb2.FAILED]
                    if later:
                        yield later[0]
                    return
                if event.phase in TERMINAL:
                    return
            sent = len(history)
            await waiter.wait()
