"""The pausable init watchdog (docs/design.md, 'The init watchdog'): one stage's
init budget, plain Python; its arithmetic of time is ``init_clock``.

Counting starts when the watchdog is built (or ``restart()``ed): the deadline is
``start + init_timeout_s`` and moves later by every second spent in a paused phase.
``DOWNLOAD_START`` pauses the clock and ``DOWNLOAD_DONE`` resumes it; ``LOAD_START`` /
``LOAD_DONE`` do the same only when "load" is in ``paused_phases``. The device-lock
wait is never paused: a stage queued behind a neighbour must not wait forever.

While a download is in progress a stall timer runs (whether or not download pauses
the clock): no growth of ``bytes_done`` for ``stall_timeout_s`` fails the stage with
a message that says it stalled, so slow is told apart from stuck.

Stream semantics, decided here so that the monitor stays a thin driver:

- ``stream_lost()``: a pause in progress ends at that moment (the paused time so far
  keeps its credit), the stall timer stops (we are blind, not stalled) and the plain
  deadline runs. If the stream comes back, events newer than the last one seen are
  applied as they arrive: a live ``DOWNLOAD_PROGRESS`` re-opens the download pause
  (and re-arms the stall timer) from that moment; the blind interval stays counted.
- Replays: InitStatus re-sends every event since the stage process started, so events
  whose ``monotonic_s`` is not after the last one seen are ignored.
- A restarted stage process replays from a new ``STARTING`` whose ``wall_time`` differs
  from the first one seen (``is_new_process``); its events look old and are ignored
  until the owner calls ``restart()``, which begins a fresh attempt with a full budget.
- READY and FAILED end an attempt: later events change nothing until ``restart()``,
  with one exception: a stage the watchdog timed out (deadline or stall) that then
  reports READY itself is taken back (READY, the message says it was late). The
  timeout was the orchestrator's verdict, not the stage's; a stage that reported
  FAILED stays FAILED until a new process appears.
- A check that comes late does not rescue the stage: ``observe`` first applies any
  deadline or stall that has already passed, so the verdict does not depend on when
  the caller happened to look.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.server.stages.init_clock import InitClock
from services.mesh.errors import DeadlineExceeded, InitFailed, OmniError
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.units import format_bytes

PAUSABLE = frozenset({"download", "load"})

STARTING = orchestrator_pb2.STAGE_STARTING
READY = orchestrator_pb2.STAGE_READY
FAILED = orchestrator_pb2.STAGE_FAILED

# Which pausable family each phase belongs to, and the phase that closes it.
_FAMILY = {
    stage_pb2.DOWNLOAD_START: "download",
    stage_pb2.DOWNLOAD_PROGRESS: "download",
    stage_pb2.DOWNLOAD_DONE: "download",
    stage_pb2.LOAD_START: "load",
    stage_pb2.LOAD_DONE: "load",
}
_CLOSES = frozenset({stage_pb2.DOWNLOAD_DONE, stage_pb2.LOAD_DONE})


class InitTimeout(DeadlineExceeded):
    """The stage used up its init budget, or its download stalled."""

    def __init__(self, message: str, *, stalled: bool = False) -> None:
        super().__init__(message)
        self.stalled = stalled


@dataclass(frozen=True)
class WatchdogSettings:
    init_timeout_s: float
    stall_timeout_s: float  # 0 or math.inf: no stall limit
    paused_phases: frozenset[str] = field(default_factory=lambda: frozenset({"download"}))

    def __post_init__(self) -> None:
        if not self.init_timeout_s > 0:
            raise ValueError(f"init_timeout_s: must be > 0, got {self.init_timeout_s}")
        if not self.stall_timeout_s >= 0:
            raise ValueError(f"stall_timeout_s: must be >= 0, got {self.stall_timeout_s}")
        unknown = set(self.paused_phases) - PAUSABLE
        if unknown:
            # Refused rather than ignored: an operator who lists the device-lock wait
            # expects it paused, and silently not doing so would surprise them later.
            raise ValueError(
                f"paused_phases: {sorted(unknown)} cannot pause the init clock; expected a "
                f"subset of {sorted(PAUSABLE)} (the device-lock wait is never paused)"
            )

    @property
    def stall_limit_s(self) -> float | None:
        return self.stall_timeout_s if 0 < self.stall_timeout_s < float("inf") else None


class Watchdog:
    def __init__(
        self,
        stage: str,
        settings: WatchdogSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stage = stage
        self.settings = settings
        self._clock = clock
        self.attempt = 0
        self._begin()

    def _begin(self) -> None:
        settings = self.settings
        self._time = InitClock(settings.init_timeout_s, settings.stall_limit_s, self._clock())
        self._state: int = STARTING
        self._phase: int = stage_pb2.INIT_PHASE_UNSPECIFIED
        self._message = ""
        self._error: OmniError | None = None
        self._bytes_done = 0
        self._bytes_total = 0
        self._source = ""
        self._last_mono: float | None = None
        self._origin: tuple[int, int] | None = None  # wall_time of the STARTING seen

    # --- inputs ---------------------------------------------------------------------

    def restart(self) -> None:
        """A new attempt (a new stage process): full budget from now, no history."""
        self.attempt += 1
        self._begin()

    def is_new_process(self, event: stage_pb2.InitEvent) -> bool:
        """True for the STARTING of a process other than the one this attempt follows
        (or of any process, when the attempt ended before one was seen)."""
        if event.phase != stage_pb2.STARTING:
            return False
        if self._origin is None:
            return self._state != STARTING
        return (event.wall_time.seconds, event.wall_time.nanos) != self._origin

    def observe(self, event: stage_pb2.InitEvent) -> None:
        if self.is_new_process(event):
            return  # the owner has yet to restart() for a new process
        if self._state == FAILED and event.phase == stage_pb2.READY:
            self._take_back(event)
            return
        if self._state != STARTING:
            return  # the attempt is over
        if self._last_mono is not None and event.monotonic_s <= self._last_mono:
            return  # a replay of something already applied
        self._last_mono = event.monotonic_s
        now = self._clock()
        if self._expire(now):
            if event.phase == stage_pb2.READY:
                self._take_back(event)
            return
        phase = event.phase
        if phase == stage_pb2.STARTING and self._origin is None:
            self._origin = (event.wall_time.seconds, event.wall_time.nanos)
        family = _FAMILY.get(phase)
        pausing = self._time.pausing
        if pausing is not None and (family != pausing or phase in _CLOSES):
            self._time.end_pause(now)
        if family == "download":
            self._on_download(event, now)
        else:
            self._time.stall_since = None  # the download is over even if its DONE went missing
        if family is not None and family in self.settings.paused_phases and phase not in _CLOSES:
            self._time.pause(family, now)
        self._phase = phase
        if event.message or event.reason:
            self._message = event.message or event.reason
        if phase == stage_pb2.READY:
            self._finish(now, READY, None)
        elif phase == stage_pb2.FAILED:
            reason = event.reason or event.message or "no reason given"
            self._finish(now, FAILED, InitFailed(f"stage {self.stage}: init failed: {reason}"))

    def _on_download(self, event: stage_pb2.InitEvent, now: float) -> None:
        if event.source:
            self._source = event.source
        if event.phase == stage_pb2.DOWNLOAD_DONE:
            self._time.stall_since = None
            self._bytes_done, self._bytes_total = event.bytes_done, event.bytes_total
            return
        if event.phase == stage_pb2.DOWNLOAD_START:
            self._bytes_done, self._time.stall_since = 0, now
        elif self._time.stall_since is None or event.bytes_done > self._bytes_done:
            self._time.stall_since = now  # progress, or the first live sign after blindness
        self._bytes_done = max(self._bytes_done, event.bytes_done)
        if event.bytes_total:
            self._bytes_total = event.bytes_total

    def _take_back(self, event: stage_pb2.InitEvent) -> None:
        """The stage reached READY after the watchdog timed it out: usable after all."""
        if not isinstance(self._error, InitTimeout):
            return  # the stage itself reported FAILED: only a new process can recover
        self._message = (
            f"ready {event.monotonic_s:.1f}s after its process started, late: taken back "
            f"after the watchdog failed it ({self._error.message})"
        )
        self._state, self._error, self._phase = READY, None, stage_pb2.READY

    def mark_ready(self, message: str) -> None:
        """Readiness learnt elsewhere (grpc health) while InitStatus is unavailable."""
        now = self._clock()
        if self._state == STARTING and not self._expire(now):
            self._message = message
            self._finish(now, READY, None)

    def stream_lost(self, message: str = "InitStatus unavailable: plain deadline") -> None:
        if self._state != STARTING:
            return
        now = self._clock()
        if self._expire(now):
            return
        self._time.end_pause(now)
        self._time.stall_since = None
        self._message = message

    def check(self) -> None:
        """Raise the attempt's error if it has failed by now (idempotent once failed)."""
        if self._state == STARTING:
            self._expire(self._clock())
        if self._error is not None:
            raise self._error

    # --- verdicts -------------------------------------------------------------------

    def _expire(self, now: float) -> bool:
        """Fail the attempt if a stall or the deadline has passed by ``now``."""
        if self._time.stalled_at(now):
            self._finish(now, FAILED, InitTimeout(self._stall_message(now), stalled=True))
        elif self._time.timed_out_at(now):
            self._finish(now, FAILED, InitTimeout(self._timeout_message(now)))
        return self._state == FAILED

    def _finish(self, now: float, state: int, error: OmniError | None) -> None:
        self._time.freeze(now)
        self._state, self._error = state, error
        if error is not None:
            self._message = error.message

    # --- messages -------------------------------------------------------------------

    def _phase_name(self) -> str:
        if self._phase == stage_pb2.INIT_PHASE_UNSPECIFIED:
            return "none (no init event seen)"
        return stage_pb2.InitPhase.Name(self._phase)

    def _timeout_message(self, now: float) -> str:
        text = f"stage {self.stage}: init timed out in phase {self._phase_name()} "
        text += self._time.budget_text(now)
        return f"{text} ({self._message})" if self._message else text

    def _stall_message(self, now: float) -> str:
        assert self._time.stall_since is not None
        total = format_bytes(self._bytes_total) if self._bytes_total else "an unknown size"
        return (
            f"stage {self.stage}: download stalled: no progress for "
            f"{now - self._time.stall_since:.1f}s at {format_bytes(self._bytes_done)} of {total} "
            f"({self._time.budget_text(now)})"
        )

    # --- outputs --------------------------------------------------------------------

    def next_check_in(self) -> float | None:
        """Seconds until ``check()`` could first fail; None when it cannot (done, or
        paused with no stall limit)."""
        return self._time.next_check_in(self._clock()) if self._state == STARTING else None

    @property
    def state(self) -> int:
        return self._state

    @property
    def phase(self) -> int:
        return self._phase

    @property
    def error(self) -> OmniError | None:
        return self._error

    @property
    def message(self) -> str:
        return self._message

    @property
    def paused(self) -> bool:
        return self._time.pausing is not None

    @property
    def counted_s(self) -> float:
        return self._time.counted_at(self._time.reading_at(self._clock()))

    @property
    def paused_s(self) -> float:
        return self._time.paused_at(self._time.reading_at(self._clock()))

    @property
    def budget_left_s(self) -> float:
        return self._time.budget_left_at(self._time.reading_at(self._clock()))

    @property
    def bytes_done(self) -> int:
        return self._bytes_done

    @property
    def bytes_total(self) -> int:
        return self._bytes_total

    def status(self, address: str) -> orchestrator_pb2.StageStatus:
        return orchestrator_pb2.StageStatus(
            name=self.stage,
            address=address,
            state=self._state,  # type: ignore[arg-type]
            phase=self._phase,  # type: ignore[arg-type]
            counted_s=self.counted_s,
            paused_s=self.paused_s,
            budget_s=self.settings.init_timeout_s,
            budget_left_s=self.budget_left_s,
            paused=self.paused,
            bytes_done=self._bytes_done,
            bytes_total=self._bytes_total,
            message=self._message,
            source=self._source,
        )
