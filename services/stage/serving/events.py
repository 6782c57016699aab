"""What the stage runtime emits per request, before the servicer turns it into protos."""

from __future__ import annotations

from dataclasses import dataclass

from services.engines.base import ProgressOutput
from services.mesh.errors import OmniError
from services.stage.serving.segmenter import Segment


@dataclass(frozen=True)
class SegmentOut:
    request_id: str
    segment: Segment


@dataclass(frozen=True)
class ProgressOut:
    request_id: str
    progress: ProgressOutput


@dataclass(frozen=True)
class CompletedOut:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    time_to_first_ms: float
    total_ms: float


@dataclass(frozen=True)
class ErrorOut:
    request_id: str
    error: OmniError


StageEvent = SegmentOut | ProgressOut | CompletedOut | ErrorOut
