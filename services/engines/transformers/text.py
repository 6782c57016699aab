"""Streaming text: incremental detokenisation and stop strings.

Both are plain Python over a tokenizer, so they are tested without a model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# How many prompt tokens seed the decoder: enough context for tokenizers whose
# decoding of a token depends on its neighbours (leading-space markers).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a character.

    The prefix/read-offset method of TGI and vLLM: decode a short window twice,
    with and without the new tokens, and emit the difference once it no longer
    ends in U+FFFD (a UTF-8 sequence still waiting for its continuation bytes).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._ids)  # tokens before this are already emitted

    def add(self, token_id: int) -> str:
        """The text token_id completes; "" while a character is still incomplete."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back at the end (a truncated character shows as U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :] if text.startswith(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenisation spaces: it rewrites text across the window edge.
        text = self._tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return cast(str, text)  # a flat id list decodes to one string


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
