"""A speech request's text as it arrives: token ids decoded incrementally and
cut into the sentences that are complete so far.

Plain Python, tested without gRPC. ``TokenText`` holds back ids whose bytes do
not yet form whole characters (a byte-level tokenizer may split "日" over three
tokens): a window boundary never garbles a character. ``Sentences`` holds back
the text after the last sentence end, so a word or a sentence split over two
windows is spoken once and whole. A sentence is complete at a newline, at end
punctuation followed by a space and more text (hibari's own rule, so the cuts
are those ``Hibari.split_sentences`` makes of the whole text), or when the text
held back passes ``max_chars`` (then cut at its last space).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hibari import Hibari

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class TokenText:
    """Token ids in, whole characters out (a byte-level BPE's slices decode
    exactly, so ids are decoded from the last point where all was emitted)."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._held: list[int] = []

    def add(self, token_ids: Sequence[int]) -> str:
        """The text these ids complete ("" while a character's bytes are missing)."""
        self._held.extend(token_ids)
        text = self._decoder.decode(self._held)
        if text.endswith(REPLACEMENT):
            return ""  # the last character is incomplete: wait for its other bytes
        self._held.clear()
        return text

    def rest(self) -> str:
        """What is held at the end of the input, decoded as it is."""
        text = self._decoder.decode(self._held) if self._held else ""
        self._held.clear()
        return text


class Sentences:
    """Text in, complete sentences out; the unfinished end is held back."""

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._held = ""

    def add(self, text: str) -> list[str]:
        self._held += text
        pieces = Hibari.split_sentences(self._held)
        if not pieces:
            return []
        last = pieces[-1]
        start = self._held.rfind(last)
        if "\n" in self._held[start + len(last) :]:
            self._held = ""  # a newline ends the last piece too
            return pieces
        done, self._held = pieces[:-1], self._held[start:]
        while len(self._held) > self._max_chars:
            cut = self._held.rfind(" ", 0, self._max_chars + 1)
            cut = cut if cut > 0 else self._max_chars
            head, self._held = self._held[:cut].strip(), self._held[cut:].lstrip()
            if head:
                done.append(head)
        return done

    def rest(self) -> list[str]:
        """The held text at the end of the input, as sentences."""
        pieces = Hibari.split_sentences(self._held)
        self._held = ""
        return pieces
