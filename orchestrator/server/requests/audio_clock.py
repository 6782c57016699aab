"""How a request's audio would play at its client: when its first packet arrived, how
much audio came in how long (the real-time factor), and how often playback, started
at the first packet, would have run dry before the next one arrived (an underrun).

What operators of a speaking pipeline watch (vLLM-Omni reports the same three):
``observe.spoken`` records them per output stage when the request ends. Plain
Python over an injectable clock; the flow feeds it each audio segment it hands the
client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.mesh.pb.omni.v1 import stage_pb2


@dataclass
class _Stream:
    first_s: float  # since the request began
    ends_s: float  # when the audio so far would have finished playing
    last_s: float
    seconds: float = 0.0
    underruns: int = 0


@dataclass
class AudioClock:
    clock: Callable[[], float] = time.monotonic
    began: float = field(default=0.0)
    streams: dict[str, _Stream] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.began = self.began or self.clock()

    def heard(self, stage: str, seconds: float) -> None:
        """``seconds`` of ``stage``'s audio reached the client now."""
        now = self.clock() - self.began
        stream = self.streams.get(stage)
        if stream is None:
            self.streams[stage] = _Stream(first_s=now, ends_s=now + seconds, last_s=now,
                                          seconds=seconds)  # fmt: skip
            return
        stream.underruns += now > stream.ends_s
        stream.ends_s = max(stream.ends_s, now) + seconds
        stream.last_s, stream.seconds = now, stream.seconds + seconds

    def segment(self, stage: str, segment: stage_pb2.Segment) -> None:
        """A segment of ``stage`` reached the client: its "audio" tensors, if any
        ([samples] or [samples, channels] at the segment's audio_format)."""
        rate = segment.audio_format.sample_rate
        for tensor in segment.tensors if rate else ():
            if tensor.name == "audio" and tensor.shape:
                self.heard(stage, tensor.shape[0] / rate)

    def real_time_factor(self, stage: str) -> float:
        """Time until the last audio arrived over the audio's length (< 1: faster
        than it plays)."""
        stream = self.streams[stage]
        return stream.last_s / stream.seconds if stream.seconds else float("inf")
