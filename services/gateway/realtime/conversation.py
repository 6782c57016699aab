"""A session's conversation: the items a client created, the audio it committed
and the answers the mesh gave, in order. The mesh is stateless: every
``response.create`` sends it the whole conversation as chat messages
(``messages``), within a budget of items and tokens, the oldest items dropped
first (the session's ``truncation``).

Tokens are the stage's own count where it is known: each response reports the
prompt it conditioned on (``input_tokens``), and the items sent for the first
time share what that count added; an answer is its ``output_tokens``. An item
not yet sent is estimated (UTF-8 bytes / 3 for text, 25 tokens a second of
audio: what audio encoders of omni models make), so a long new item is counted
before the stage would refuse it.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.realtime.session_config import RATE
from services.mesh import wav
from services.mesh.pb.omni.v1 import stage_pb2

Role = Literal["user", "assistant", "system"]
AUDIO_TOKENS_PER_S = 25


@dataclass
class Part:
    """One content part: text, or 16-bit PCM at 24 kHz (with its transcript, if any)."""

    type: str  # input_text, input_audio, output_text, output_audio
    text: str = ""
    pcm: bytes = b""
    audio_bytes: int = 0  # an answer's audio, as sent to the client (the mesh keeps none)
    heard_ms: int | None = None  # the client played only this much of it (truncate)
    whole: str = ""  # an answer's whole text, before any truncate

    def truncate(self, heard_ms: int) -> None:
        """The client played ``heard_ms`` of this answer's audio: the transcript
        keeps the words said by then, by their share of the audio (the speech
        stage reports no word times). A cut holds for an answer still being
        written, and a later, shorter one cuts more."""
        if not self.audio_bytes:
            return  # no audio of it was sent: nothing was left unheard
        self.heard_ms = heard_ms if self.heard_ms is None else min(self.heard_ms, heard_ms)
        self._cut()

    def finish(self, text: str) -> None:
        """The answer's whole text, cut to what was heard if it was truncated."""
        self.whole = self.text = text
        self._cut()

    def _cut(self) -> None:
        if self.heard_ms is None:
            return
        heard = self.heard_ms * 2 * RATE // 1000
        words = list(re.finditer(r"\S+", self.whole))
        kept = len(words) * min(heard, self.audio_bytes) // self.audio_bytes
        self.text = self.whole[: words[kept - 1].end()] if kept else ""

    def view(self) -> dict[str, Any]:
        """As the client sees it: audio is never sent back (it has it)."""
        if self.type == "input_audio":
            return {"type": "input_audio", "transcript": self.text or None}
        if self.type == "output_audio":
            return {"type": "output_audio", "transcript": self.text}
        return {"type": self.type, "text": self.text}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(eq=False)  # an item is itself: two alike are still two turns
class Item:
    role: Role
    parts: list[Part]
    id: str = field(default_factory=lambda: new_id("item"))
    status: Literal["completed", "in_progress", "incomplete"] = "completed"
    tokens: int | None = None  # measured by the stage, once sent

    @property
    def estimate(self) -> int:
        if self.tokens is not None:
            return self.tokens
        text = sum(len(p.text.encode()) for p in self.parts if not p.pcm)
        seconds = sum(len(p.pcm) for p in self.parts) / (2 * RATE)
        return 4 + math.ceil(text / 3 + seconds * AUDIO_TOKENS_PER_S)

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [p.view() for p in self.parts],
        }

    def message(self, audio: bool = True) -> stage_pb2.ChatMessage:
        """The item as the mesh's chat message: text alone as a string (as a chat
        completion's string content), audio as a WAV content part; without
        ``audio`` (an entry stage that takes none) audio as its transcript."""
        if not audio:
            said = " ".join(p.text.strip() for p in self.parts if p.text.strip())
            return stage_pb2.ChatMessage(role=self.role, content=said)
        if all(not p.pcm for p in self.parts):
            return stage_pb2.ChatMessage(
                role=self.role, content="".join(p.text for p in self.parts)
            )
        out = stage_pb2.ChatMessage(role=self.role)
        for part in self.parts:
            piece = out.parts.add()
            if part.pcm:  # filled field by field: a constructor would re-encode the bytes
                piece.audio.media_type = wav.MEDIA_TYPE
                piece.audio.data = wav.header(RATE, 1, len(part.pcm)) + part.pcm
            else:
                piece.text = part.text
        return out


@dataclass(frozen=True)
class Budget:
    max_items: int
    max_tokens: int
    retention: float = 1.0  # what is left of max_tokens once over it


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []
        self.dropped = 0  # items dropped for the budget, all told

    def add(self, item: Item, after: str | None = None) -> str | None:
        """Insert ``item`` after the item ``after`` (None: at the end); returns
        the id of the item before it. KeyError for an unknown ``after``."""
        index = len(self.items) if after is None else self.index(after) + 1
        self.items.insert(index, item)
        return self.items[index - 1].id if index else None

    def index(self, item_id: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise KeyError(item_id)

    def remove(self, item_id: str) -> None:
        del self.items[self.index(item_id)]

    def within(self, budget: Budget) -> list[Item]:
        """Drop the oldest items until the rest fit ``budget``; returns what is kept."""
        drop = max(0, len(self.items) - budget.max_items)
        tokens = [item.estimate for item in self.items]
        total = sum(tokens[drop:])
        if total > budget.max_tokens:
            target = budget.max_tokens * budget.retention
            while drop < len(self.items) - 1 and total > target:
                total -= tokens[drop]
                drop += 1
        if drop:
            self.dropped += drop
            del self.items[:drop]
        return list(self.items)

    def measured(self, sent: list[Item], input_tokens: int) -> None:
        """The stage counted ``input_tokens`` for ``sent``: the items sent for the
        first time share what the known ones leave, by their estimates."""
        fresh = [item for item in sent if item.tokens is None]
        known = sum(item.tokens or 0 for item in sent if item.tokens is not None)
        left = max(0, input_tokens - known)
        weights = [item.estimate for item in fresh]
        whole = sum(weights) or 1
        shares = [left * w // whole for w in weights]
        if shares:
            shares[-1] += left - sum(shares)  # what rounding left over: the count stays exact
        for item, share in zip(fresh, shares, strict=True):
            item.tokens = share
