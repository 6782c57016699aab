"""The speech engine's settings (``engine_args``) and a request's limits."""

from __future__ import annotations

from pydantic import Field, field_validator

from services.engines.engine_args import EngineArgs

MIN_SPEED, MAX_SPEED = 0.5, 2.0  # hibari's range: half to twice the teacher's pace


class SpeechArgs(EngineArgs):
    """``voices``: the hibari voices this stage offers, the first the default
    (each must be in the package or already in hibari's cache: the stage never
    downloads a voice on its own). ``max_text_chars``: the most text one request
    may speak (every window of it together). ``max_sentence_chars``: text held
    back without a sentence end is spoken in pieces of at most this much."""

    voices: tuple[str, ...] = Field(("heart",), min_length=1)
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    max_text_chars: int = Field(8000, ge=1)
    max_sentence_chars: int = Field(300, ge=16)
    threads: int = Field(1, ge=1)  # onnxruntime threads per voice
    max_streams: int = Field(64, ge=1)  # requests whose held text the engine keeps at once

    @field_validator("voices")
    @classmethod
    def _known(cls, voices: tuple[str, ...]) -> tuple[str, ...]:
        from hibari.voices import VOICES

        unknown = [v for v in voices if v not in VOICES]
        if unknown:
            raise ValueError(f"unknown voice(s) {unknown} (hibari has: {', '.join(VOICES)})")
        return voices
