"""A fake clock and a stage's init events as InitStatus would bring them, driving
a real Watchdog: the watchdog tests' script."""

from __future__ import annotations

import pytest

from orchestrator.server.stages.watchdog import InitTimeout, Watchdog, WatchdogSettings
from services.mesh.errors import InitFailed
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Stage:
    """Feeds events to a watchdog as a stage would: monotonic offsets always grow."""

    def __init__(self, watchdog: Watchdog, clock: Clock, wall_s: int = 1_700_000_000) -> None:
        self.watchdog, self.clock, self.mono, self.wall_s = watchdog, clock, 0.0, wall_s
        self.sent: list[stage_pb2.InitEvent] = []

    def event(self, phase: int, after_s: float = 0.0, **fields: object) -> stage_pb2.InitEvent:
        self.clock.advance(after_s)
        self.mono += after_s + 0.001
        event = stage_pb2.InitEvent(stage="s", phase=phase, monotonic_s=self.mono, **fields)  # type: ignore[arg-type]
        event.wall_time.seconds = self.wall_s
        self.sent.append(event)
        self.watchdog.observe(event)
        return event


def make(
    init: float = 10.0, stall: float = 5.0, paused: frozenset[str] = frozenset({"download"})
) -> tuple[Watchdog, Clock, Stage]:
    clock = Clock()
    watchdog = Watchdog("thinker", WatchdogSettings(init, stall, paused), clock)
    return watchdog, clock, Stage(watchdog, clock)


def failure(watchdog: Watchdog) -> str:
    with pytest.raises((InitTimeout, InitFailed)) as caught:
        watchdog.check()
    return caught.value.message


def failure_free(watchdog: Watchdog) -> bool:
    watchdog.check()
    return watchdog.state == orchestrator_pb2.STAGE_STARTING
