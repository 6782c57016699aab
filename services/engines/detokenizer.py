"""The text new tokens add, streamed without re-decoding the answer: a growing token
list turned into deltas that never split a character. Every engine that streams
text from a Hugging Face tokenizer uses it (the transformers engine, the Qwen3-Omni
thinker); plain Python over a tokenizer, tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

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
