"""Groups an autoregressive request's tokens into segments.

A segment is flushed when ``max_segment_tokens`` are pending, when
``min_flush_interval`` has passed since the last flush, or when the request ends.
The first segment that carries tokens may leave sooner, once it holds
``first_tokens`` (the stage's ``first_segment_tokens``, 1 by default): a client
waits for the first token, and batching it with the next ones only adds to that wait.
Sequence numbers start at 0 and increase by one per segment.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engines.base import AudioFormat, Blob, TensorOutput, TokenOutput


@dataclass(frozen=True)
class Segment:
    sequence: int
    is_last: bool
    token_ids: tuple[int, ...] = ()
    text: str = ""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    blobs: tuple[Blob, ...] = ()
    audio_format: AudioFormat | None = None


class Segmenter:
    def __init__(
        self,
        max_tokens: int,
        min_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        first_tokens: int | None = None,
    ) -> None:
        self._max_tokens = max_tokens
        self._first_tokens = max_tokens if first_tokens is None else min(first_tokens, max_tokens)
        self._sent_tokens = False  # whether a segment with tokens has left
        self._interval = min_interval_s
        self._clock = clock
        self._last_flush = clock()
        self._sequence = 0
        self._ids: list[int] = []
        self._text: list[str] = []
        self._hidden: list[torch.Tensor] = []
        self._tensors: dict[str, torch.Tensor] = {}
        self._blobs: list[Blob] = []
        self._audio_format: AudioFormat | None = None

    @property
    def pending(self) -> int:
        return len(self._ids)

    def add(self, out: TokenOutput) -> bool:
        """Take new tokens; True when a flush is due now."""
        self._ids.extend(out.token_ids)
        self._text.append(out.text)
        if out.hidden_states is not None:
            self._hidden.append(out.hidden_states)
        return self.due_in() == 0.0

    def holds(self, out: TensorOutput) -> bool:
        """Whether ``out`` would replace a tensor not flushed yet (flush first)."""
        return any(name in self._tensors for name in out.tensors)

    def add_outputs(self, out: TensorOutput) -> None:
        """Whole outputs (an image) ride with the next flush, usually the last one."""
        self._tensors.update(out.tensors)
        self._blobs.extend(out.blobs)
        self._audio_format = out.audio_format or self._audio_format

    def due_in(self) -> float | None:
        """Seconds until a time-based flush is due, or None with nothing pending."""
        if not self._ids:
            return None
        if len(self._ids) >= (self._max_tokens if self._sent_tokens else self._first_tokens):
            return 0.0
        return max(0.0, self._last_flush + self._interval - self._clock())

    def flush(self, is_last: bool = False) -> Segment | None:
        """What is pending as one segment; None if nothing is pending and not last."""
        if not (self._ids or self._tensors or self._blobs or is_last):
            return None
        tensors = dict(self._tensors)
        if self._hidden:
            tensors["hidden_states"] = torch.cat(self._hidden)
        segment = Segment(
            self._sequence,
            is_last,
            tuple(self._ids),
            "".join(self._text),
            tensors,
            tuple(self._blobs),
            self._audio_format if "audio" in tensors else None,
        )
        self._sequence += 1
        self._sent_tokens = self._sent_tokens or bool(self._ids)
        self._ids, self._text, self._hidden, self._blobs = [], [], [], []
        self._tensors = {}
        self._audio_format = None
        self._last_flush = self._clock()
        return segment
