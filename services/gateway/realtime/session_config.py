"""A realtime session's settings (the GA ``session`` object), validated once per
``session.update`` and replaced whole, never mutated: an update is merged into
what the session has (fields it leaves out keep their values) and the result is
validated, so an error names the field as the client spelt it
(``session.audio.output.format.rate``) and a refused update changes nothing.

What the mesh cannot do is refused by name rather than ignored: audio formats
other than 16-bit PCM at 24 kHz, ``semantic_vad``, tools, input transcription,
noise reduction. Fields that OpenAI's SDKs and frameworks send are accepted at
their neutral values (``tools: []``, ``tool_choice: "auto"``, ``tracing: null``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.schema import validate

RATE: Literal[24000] = 24000  # the only PCM rate: OpenAI's, and the speech stages'


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AudioFormat(_Part):
    type: Literal["audio/pcm"] = "audio/pcm"  # pcmu/pcma (G.711) are refused by name
    rate: Literal[24000] = RATE


class TurnDetection(_Part):
    """Server VAD (vad.py); ``semantic_vad`` needs a model of turn-taking the mesh lacks."""

    type: Literal["server_vad"]
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=5000)
    silence_duration_ms: int = Field(500, ge=0, le=10000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: None = None


class AudioInput(_Part):
    format: AudioFormat = AudioFormat()
    turn_detection: TurnDetection | None = None
    transcription: None = None  # input audio goes to the model itself, not transcribed
    noise_reduction: None = None


class AudioOutput(_Part):
    format: AudioFormat = AudioFormat()
    voice: str = "alloy"  # an alias of the speech stage's default voice (voices.py)
    speed: float = Field(1.0, gt=0)  # the speech stage checks its range

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {"id"}:
            return value["id"]  # the SDK's {"id": ...} form of a voice
        return value


class Audio(_Part):
    input: AudioInput = AudioInput()
    output: AudioOutput = AudioOutput()


class TokenLimits(_Part):
    post_instructions: int = Field(ge=1)


class RetentionRatio(_Part):
    """Past ``token_limits.post_instructions`` tokens of conversation, the oldest
    items are dropped until ``retention_ratio`` of the limit is left."""

    type: Literal["retention_ratio"]
    retention_ratio: float = Field(gt=0.0, le=1.0)
    token_limits: TokenLimits | None = None


class SessionConfig(_Part):
    type: Literal["realtime"] = "realtime"
    model: str | None = None  # the pipeline's name (checked when the session opens)
    instructions: str = ""
    output_modalities: list[Literal["text", "audio"]] = Field(["audio"], min_length=1, max_length=1)
    max_output_tokens: int | Literal["inf"] = "inf"
    audio: Audio = Audio()
    truncation: Literal["auto", "disabled"] | RetentionRatio = "auto"
    # Accepted at their neutral values only: the mesh has no tools or tracing of its own.
    tools: list[None] = Field([], max_length=0)
    tool_choice: Literal["auto", "none"] = "auto"
    tracing: None = None
    prompt: None = None
    include: list[None] | None = Field(None, max_length=0)

    @field_validator("max_output_tokens")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("expected a positive number of tokens, or 'inf'")
        return value

    @property
    def speaks(self) -> bool:
        return self.output_modalities == ["audio"]

    @property
    def max_tokens(self) -> int | None:
        return None if self.max_output_tokens == "inf" else int(self.max_output_tokens)

    def updated(self, change: Any) -> SessionConfig:
        """This session with ``change`` (a ``session.update``'s ``session``) merged in."""
        if not isinstance(change, dict):
            return validate(SessionConfig, change, prefix="session")  # names the type error
        merged = _merge(self.model_dump(mode="json"), change)
        return validate(SessionConfig, merged, prefix="session")


def _merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """``change`` over ``base``, object by object; anything else (null, lists) replaces."""
    out = dict(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
