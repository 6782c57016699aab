"""Streaming text: stop strings, cut from the text the detokenizer
(services/engines/detokenizer.py) streams. Plain Python, tested without a model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)


class StopStrings:
    """Cuts streamed text at the first stop string, holding back any tail that
    could still grow into one, so no text past a stop string is ever emitted."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""  # received but not yet emitted
        self.stopped = False

    def add(self, delta: str) -> str:
        """The part of delta (plus earlier held-back text) that is safe to emit."""
        if self.stopped:
            return ""
        self._pending += delta
        if not self._stops:
            out, self._pending = self._pending, ""
            return out
        # Nothing emitted can start a stop string (it would have been held back),
        # so searching the pending text alone finds every match.
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        keep = self._held_back()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back tail once the text has ended without a stop string."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that starts a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
