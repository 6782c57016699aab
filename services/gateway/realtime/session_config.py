"""A realtime session's settings (the GA ``session`` object), validated once per
``session.update`` and replaced whole, never mutated: an update is merged into
what the session has (fields it leaves out keep their values) and the result is
validated. A field the mesh cannot serve is refused by name, as the client spelt
it (``session.audio.output.format.rate``), and left as it was; every other field
of the same update still applies (``updated`` returns both), so an agent's
``instructions`` never depend on an unrelated setting.

Refused: audio formats other than 16-bit PCM at 24 kHz, function tools, unknown
fields. Accepted for what they do here (docs/api.md): ``semantic_vad`` (server
VAD, its ``eagerness`` a silence duration), ``transcription`` (the recogniser's
transcript of each committed turn, when the pipeline has one), ``noise_reduction``
and ``tracing`` (nothing: no filter, no traces leave the mesh).
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.gateway.errors import ApiError
from services.gateway.schema import refusal, validate

RATE: Literal[24000] = 24000  # the only PCM rate: OpenAI's, and the speech stages'
# semantic_vad's eagerness as server VAD's silence before a turn ends: "auto" and
# "medium" are server VAD's default; "low" waits about twice that, "high" half.
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 250}
# The beta session's top-level names, moved to where the GA session keeps them.
BETA_FIELDS = {
    "input_audio_transcription": ("audio", "input", "transcription"),
    "turn_detection": ("audio", "input", "turn_detection"),
    "input_audio_noise_reduction": ("audio", "input", "noise_reduction"),
}


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AudioFormat(_Part):
    type: Literal["audio/pcm"] = "audio/pcm"  # pcmu/pcma (G.711) are refused by name
    rate: Literal[24000] = RATE


class ServerVadSettings(_Part):
    """Server VAD (vad.py)."""

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=5000)
    silence_duration_ms: int = Field(500, ge=0, le=10000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: None = None


class SemanticVadSettings(_Part):
    """``semantic_vad``: no model of turn-taking ships offline, so it is server
    VAD whose silence duration comes from ``eagerness``; ``silence_duration_ms``
    says which (set from ``eagerness`` whatever the client sends)."""

    type: Literal["semantic_vad"]
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"
    create_response: bool = True
    interrupt_response: bool = True
    silence_duration_ms: int = 500

    @model_validator(mode="before")
    @classmethod
    def _silence(cls, data: Any) -> Any:
        if isinstance(data, dict):
            eagerness = data.get("eagerness", "auto")
            data = {**data, "silence_duration_ms": EAGERNESS_SILENCE_MS.get(eagerness, 500)}
        return data

    @property
    def threshold(self) -> float:
        return ServerVadSettings().threshold

    @property
    def prefix_padding_ms(self) -> int:
        return ServerVadSettings().prefix_padding_ms


VAD_TYPES = frozenset({"server_vad", "semantic_vad"})
TurnDetection = Annotated[ServerVadSettings | SemanticVadSettings, Field(discriminator="type")]


class Transcription(_Part):
    """Input transcription: each committed turn's transcript comes from the
    pipeline's recogniser stage (its own model; ``model`` names OpenAI's)."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class NoiseReduction(_Part):
    type: Literal["near_field", "far_field"]
    strength: float | None = Field(None, ge=0.0)


class Tracing(_Part):
    workflow_name: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] | None = None


class AudioInput(_Part):
    format: AudioFormat = AudioFormat()
    turn_detection: TurnDetection | None = None
    transcription: Transcription | None = None
    noise_reduction: NoiseReduction | None = None  # accepted: no filter runs here


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
    # Tools at their neutral values only: the mesh calls no functions.
    tools: list[None] = Field([], max_length=0)
    tool_choice: Literal["auto", "none"] = "auto"
    tracing: Literal["auto"] | Tracing | None = None  # accepted: no traces leave the mesh
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

    def updated(self, change: Any) -> tuple[SessionConfig, list[ApiError]]:
        """This session with ``change`` (a ``session.update``'s ``session``) merged
        in, and the refusals of the fields left as they were (each names its
        field). A ``change`` that is not an object is refused whole."""
        if not isinstance(change, dict):
            validate(SessionConfig, change, prefix="session")  # names the type error
        change = _ga(change)
        base = self.model_dump(mode="json")
        refused: list[ApiError] = []
        while True:
            try:
                return SessionConfig.model_validate(_merge(base, change)), refused
            except ValidationError as exc:
                error = refusal(exc, "session", VAD_TYPES)
                smaller = _without(change, exc.errors()[0]["loc"])
                if smaller is None:  # nothing of the change to blame: refused whole
                    raise error from None
                refused.append(error)
                change = smaller


def _ga(change: dict[str, Any]) -> dict[str, Any]:
    """The beta session's top-level fields moved to their GA places."""
    if not BETA_FIELDS.keys() & change.keys():
        return change
    out = copy.deepcopy(change)
    for name, path in BETA_FIELDS.items():
        if name in out:
            value = out.pop(name)
            node = out
            for key in path[:-1]:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            node.setdefault(path[-1], value)  # the GA field wins over its beta name
    return out


def _without(change: dict[str, Any], loc: tuple[int | str, ...]) -> dict[str, Any] | None:
    """``change`` without the field an error at ``loc`` blames: the deepest field
    the change itself gave, or the object it gave whose inside was wrong. None
    when the change gave none of it."""
    path: list[str] = []
    node: Any = change
    for key in loc:
        if not (isinstance(node, dict) and isinstance(key, str) and key in node):
            break
        path.append(key)
        node = node[key]
        if not isinstance(node, dict):
            break
    if not path:
        return None
    out = copy.deepcopy(change)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return out


def _merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """``change`` over ``base``, object by object; anything else (null, lists)
    replaces, and so does an object of another ``type`` (server_vad to semantic_vad)."""
    out = dict(base)
    for key, value in change.items():
        old = out.get(key)
        if (
            isinstance(value, dict)
            and isinstance(old, dict)
            and value.get("type", old.get("type")) == old.get("type")
        ):
            out[key] = _merge(old, value)
        else:
            out[key] = value
    return out
