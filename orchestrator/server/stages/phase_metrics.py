"""One stage's init phase durations as metrics (``omni.stage.init.phase.duration``), each
event once: InitStatus replays a stage's events to every new reader, and a new
process starts the count over."""

from __future__ import annotations

from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.telemetry import metrics, tracing


class PhaseDurations:
    def __init__(self, stage: str) -> None:
        self._stage = stage
        self._last = -1.0  # the monotonic time of the last event recorded

    def new_process(self) -> None:
        self._last = -1.0

    def record(self, event: stage_pb2.InitEvent) -> None:
        if not tracing.ENABLED or event.monotonic_s <= self._last:
            return
        self._last = event.monotonic_s
        if event.duration_ms:
            phase = stage_pb2.InitPhase.Name(event.phase)
            attributes = {"omni.stage": self._stage, "omni.init.phase": phase}
            metrics.INIT_PHASE_DURATION.record(event.duration_ms / 1e3, attributes)
