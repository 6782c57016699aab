"""The speech engine's settings (``engine_args``) and a request's limits."""

from __future__ import annotations

from pydantic import Field, field_validator

from services.engines.engine_args import EngineArgs
from services.mesh.config_files import Frozen

MIN_SPEED, MAX_SPEED = 0.5, 2.0  # hibari's range: half to twice the teacher's pace


class VoiceSource(Frozen):
    """A voice that is not one of hibari's names: a voice file (one ONNX model
    of hibari's architecture) or a folder or archive holding one, fetched by the
    stage like a model (a path, ``http(s)://…[#sha256=…]``, ``hf://org/name``).
    ``name`` is what requests ask for (``params.extra.voice``); ``british`` picks
    hibari's British spelling-to-sound rules instead of the American ones."""

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    british: bool = False


class SpeechArgs(EngineArgs):
    """``voices``: the voices this stage offers, the first the default: a hibari
    voice name (in the package, or already in hibari's cache: a name alone is
    never downloaded) or a ``VoiceSource`` the stage fetches in its download
    phase. ``max_text_chars``: the most text one input may carry (a request's
    text, or one window of a streamed answer: an answer of any length is spoken
    window by window in bounded memory), and with ``extra.return_wav`` the most
    of the whole (its WAV is held to the end). ``max_sentence_chars``: text held
    back without a sentence end is spoken in pieces of at most this much."""

    voices: tuple[str | VoiceSource, ...] = Field(("heart",), min_length=1)
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    max_text_chars: int = Field(8000, ge=1)
    max_sentence_chars: int = Field(300, ge=16)
    threads: int = Field(1, ge=1)  # onnxruntime threads per voice
    max_streams: int = Field(64, ge=1)  # requests whose held text the engine keeps at once

    @field_validator("voices")
    @classmethod
    def _known(cls, voices: tuple[str | VoiceSource, ...]) -> tuple[str | VoiceSource, ...]:
        from hibari.voices import VOICES

        unknown = [v for v in voices if isinstance(v, str) and v not in VOICES]
        if unknown:
            raise ValueError(
                f"unknown voice(s) {unknown} (hibari has: {', '.join(VOICES)}; a voice file "
                "is given as {name: ..., source: ...})"
            )
        names = [v if isinstance(v, str) else v.name for v in voices]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"{doubled} named more than once")
        return voices

    @property
    def voice_names(self) -> list[str]:
        return [v if isinstance(v, str) else v.name for v in self.voices]

    @property
    def fetched_voices(self) -> dict[str, VoiceSource]:
        """The voices the stage fetches before ``load``, by name."""
        return {v.name: v for v in self.voices if isinstance(v, VoiceSource)}
