"""How long a prompt may be before it is tokenized: a bound in characters.

Tokenizing costs time and memory in proportion to the text, so a 40 MB prompt
checked against ``max_prompt_tokens`` only after tokenizing would cost the stage
seconds of CPU and gigabytes before it is refused. No token covers more text
than its longest entry in the vocabulary, so a text longer than
``max_prompt_tokens * longest_token * SAFETY`` characters cannot fit and is
refused at once, by its length alone (``len`` of a ``str`` is O(1)).

Why the vocabulary's longest string bounds what one token covers: in a
byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM2) every character of a token
string stands for one byte of text, and a character of text is at least one
byte; in a SentencePiece vocabulary a token string is its text with ``▁`` for a
space, and a byte-fallback token (``<0xE2>``) is longer than the one byte it
covers; added and special tokens are counted as they are written. The bound can
only be wrong for a tokenizer whose normalizer shrinks text (NFKC composing
``e`` and a combining accent into ``é``, whitespace collapsed), hence ``SAFETY``:
a prompt over the bound by more than that factor is refused even if such a
normalizer would have squeezed it under the limit, with a message that says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.mesh.errors import InvalidArgument

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SAFETY = 2  # see the module docstring: normalizers that shrink text


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest string any one token of ``tokenizer`` stands for, in characters
    (the vocabulary and added/special tokens); computed once at load."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    added = tokenizer.added_tokens_decoder.values()
    longest = max([longest, *(len(token.content) for token in added)])
    return max(longest, 1)


@dataclass(frozen=True)
class PromptBound:
    """The stage's ``max_prompt_tokens`` as checks that run before tokenizing."""

    max_tokens: int
    token_chars: int  # longest_token_chars of the tokenizer

    @property
    def max_chars(self) -> int:
        return self.max_tokens * self.token_chars * SAFETY

    def check_text(self, field: str, text: str) -> None:
        self._check_chars(field, len(text))

    def check_messages(self, field: str, messages: Sequence[tuple[str, str]]) -> None:
        # A chat template only adds tokens around the contents: their length bounds.
        self._check_chars(field, sum(len(role) + len(content) for role, content in messages))

    def check_count(self, field: str, count: int, what: str = "token ids") -> None:
        """Token ids or embedding rows: counted before anything scans them."""
        if count > self.max_tokens:
            raise InvalidArgument(
                f"{field}: prompt has {count} {what}, the limit is {self.max_tokens} "
                "(runtime.max_prompt_tokens)",
                field=field,
            )

    def _check_chars(self, field: str, chars: int) -> None:
        if chars > self.max_chars:
            raise InvalidArgument(
                f"{field}: prompt has {chars} characters; at most {self.max_chars} can fit "
                f"the limit of {self.max_tokens} tokens (runtime.max_prompt_tokens; no token "
                f"of this model covers more than {self.token_chars} characters); it was "
                "refused without tokenizing",
                field=field,
            )
