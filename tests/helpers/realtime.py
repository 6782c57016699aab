"""A realtime turn through the official SDK (``client.realtime.connect``): what a
client gets from ``response.create`` up to its ``response.done``."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI


@dataclass
class Turn:
    events: list[dict[str, Any]] = field(default_factory=list)  # every event, in order
    done: dict[str, Any] | None = None  # response.done's response

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    @property
    def pcm(self) -> bytes:
        return b"".join(
            base64.b64decode(e["delta"]) for e in self.of("response.output_audio.delta")
        )

    @property
    def transcript(self) -> str:
        return "".join(e["delta"] for e in self.of("response.output_audio_transcript.delta"))

    @property
    def text(self) -> str:
        return "".join(e["delta"] for e in self.of("response.output_text.delta"))

    @property
    def status(self) -> str:
        assert self.done is not None
        return str(self.done["status"])


def sdk(base_url: str, api_key: str = "x") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


async def until(connection: Any, kind: str) -> list[dict[str, Any]]:
    """Every event up to and with the first of ``kind``."""
    seen = []
    async for event in connection:
        seen.append(event.model_dump(mode="json"))
        if event.type == kind:
            return seen
    raise AssertionError(f"the session ended before {kind}: {seen[-3:]}")


async def respond(connection: Any, **response: Any) -> Turn:
    """``response.create`` (with ``response`` settings, if any), then its events."""
    await connection.response.create(**({"response": response} if response else {}))
    return await read_turn(connection)


async def read_turn(connection: Any) -> Turn:
    turn = Turn()
    async for event in connection:
        data = event.model_dump(mode="json")
        turn.events.append(data)
        if event.type == "response.done":
            turn.done = data["response"]
            return turn
    raise AssertionError(f"the session ended before response.done: {turn.events[-3:]}")


def user_text(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def user_audio(pcm: bytes) -> dict[str, Any]:
    audio = base64.b64encode(pcm).decode()
    return {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}
