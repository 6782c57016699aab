"""A plug-in engine that takes text, images and audio and answers with what it got
(``engine: "services.testing.media_engine:MediaEngine"``), so a test asserts on the
receiving side: each turn's role and text, and each part in order with its kind,
media type, size and SHA-256 of its bytes (PCM: of its float32 samples, with
dtype, shape and sample rate). The answer is that record as JSON, in one token.
``TextOnlyEngine`` is the same engine without ``accepts`` (text only, the default).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

from services.engines.base import (
    ChatTurn,
    EngineEvent,
    EnginePlan,
    EngineSettings,
    FinishOutput,
    MediaPart,
    TokenOutput,
)
from services.testing.fake_engine import FakeEngine


def part_record(part: str | MediaPart) -> dict[str, Any]:
    if isinstance(part, str):
        return {"text": part}
    if part.pcm is not None:
        samples = part.pcm.contiguous()
        return {
            "kind": part.kind,
            "media_type": part.media_type,
            "dtype": str(samples.dtype).removeprefix("torch."),
            "shape": list(samples.shape),
            "sample_rate": part.sample_rate,
            "sha256": hashlib.sha256(samples.numpy().tobytes()).hexdigest(),
        }
    return {
        "kind": part.kind,
        "media_type": part.media_type,
        "nbytes": len(part.data),
        "sha256": hashlib.sha256(part.data).hexdigest(),
    }


def turn_record(turn: ChatTurn) -> dict[str, Any]:
    return {
        "role": turn.role,
        "content": turn.content,
        "parts": [part_record(p) for p in turn.parts],
    }


class TextOnlyEngine(FakeEngine):
    """No ``accepts``: text only, the default every existing engine has."""

    description: ClassVar[str] = "media echo test engine"
    name: ClassVar[str] = "text-echo"
    supported_params: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    output_tensors: ClassVar[tuple[str, ...]] = ()

    async def generate(self, plan: EnginePlan) -> AsyncGenerator[EngineEvent, None]:
        request = plan.request
        record = {
            "messages": [list(m) for m in request.messages],
            "turns": [turn_record(t) for t in request.turns],
        }
        if request.tensors:  # hashed like media, so a benchmark compares like with like
            record["tensors"] = {
                name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
                for name, t in request.tensors.items()
            }
        yield TokenOutput(token_ids=(0,), text=json.dumps(record))
        yield FinishOutput("done", prompt_tokens=len(request.messages), completion_tokens=1)


class MediaEngine(TextOnlyEngine):
    """Takes text, images and audio; ``engine_args: {accepts: [text, image]}`` narrows
    that for one stage (read per instance, as ``accepted_kinds`` reads it)."""

    name: ClassVar[str] = "media-echo"
    accepts: frozenset[str] = frozenset({"text", "image", "audio"})

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        kinds = dict(settings.engine_args).get("accepts")
        if kinds is not None:
            self.accepts = frozenset(kinds)
