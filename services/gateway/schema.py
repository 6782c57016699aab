"""The OpenAI request bodies the gateway accepts, validated once at the edge.

Unknown fields are refused by name rather than ignored, so a client never
believes a setting took effect when it did not; a few fields OpenAI's SDKs and
frameworks send are accepted at their neutral values only. Audio out (chat's
``modalities``/``audio``, /v1/audio/speech) needs the pipeline's speech stage;
its formats are wav and 16-bit PCM (audio_out.py says why).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from services.gateway.errors import ApiError

M = TypeVar("M", bound=BaseModel)


def _only_one(n: int | None) -> int | None:
    if n is not None and n != 1:
        raise ValueError("only n=1 is supported: one result per request")
    return n


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    # Text, or a list of content parts (services/gateway/content.py maps them).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # accepted; a chat template has nowhere to put it


class StreamOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # e.g. include_obfuscation
    include_usage: bool = False


class ChatAudio(_Body):
    """``audio`` of a chat request: the speech stage's voice (it refuses one it
    lacks), and the format of ``message.audio.data``."""

    voice: str | None = None  # None: the stage's default voice
    format: Literal["wav", "pcm16"] = "wav"


class ChatRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # the stage checks the range and names it
    top_p: float | None = None
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted at their neutral values only.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudio | None = None

    _n = field_validator("n")(_only_one)

    @model_validator(mode="after")
    def _audio_asked_for(self) -> ChatRequest:
        # An ApiError passes through pydantic as it is: these name their field.
        if self.audio is not None and not self.speaks:
            raise _bad("audio", "given, but modalities does not include 'audio'")
        if self.speaks and self.stream and self.audio_format != "pcm16":
            raise _bad("audio.format", "a streamed answer's audio is pcm16 (as OpenAI's)")
        return self

    @property
    def speaks(self) -> bool:
        """Audio out asked for (``modalities`` includes "audio")."""
        return "audio" in (self.modalities or ())

    @property
    def audio_format(self) -> str:
        return self.audio.format if self.audio is not None else "wav"

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (0 or unset only)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @property
    def max_tokens_field(self) -> str:
        """The field the token limit came from (for errors that name it)."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ImageRequest(_Body):
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int | None = None
    size: str | None = Field(None, pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")
    response_format: Literal["b64_json"] | None = None  # no URLs: nothing is stored
    output_format: Literal["png"] | None = None
    user: str | None = None

    _n = field_validator("n")(_only_one)

    @property
    def height_width(self) -> tuple[int, int] | None:
        if self.size is None:
            return None
        width, height = (int(x) for x in self.size.split("x"))
        return height, width


class SpeechRequest(_Body):
    """/v1/audio/speech. ``response_format`` ``pcm`` is raw 16-bit little-endian
    at the stage's rate (24 kHz for hibari), as OpenAI's; unset means wav (OpenAI's
    default, mp3, needs an encoder the mesh does not ship)."""

    model: str
    input: str = Field(min_length=1, max_length=4096)
    voice: str
    response_format: Literal["wav", "pcm"] = "wav"
    speed: float | None = None  # the stage checks its range and names it
    stream_format: Literal["audio"] | None = None  # the body is the audio itself

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_name(cls, value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {"id"}:
            return value["id"]  # the SDK's {"id": ...} form of a voice
        return value


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def validate(model: type[M], data: Any, *, prefix: str = "") -> M:
    """``data`` (a part of a body, at ``prefix``) as ``model``, or a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise refusal(exc, prefix) from None


def parse(model: type[M], body: bytes) -> M:
    """A JSON request body as ``model`` (400 for bad JSON or a bad field)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise refusal(exc) from None


def refusal(exc: ValidationError, prefix: str = "", tags: frozenset[str] = frozenset()) -> ApiError:
    """A 400 naming the first offending field, as the request spells it
    (``tags``: a tagged union's tags, which pydantic puts in the location)."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {error['msg']}")
    param = _path(prefix, tuple(part for part in error["loc"] if part not in tags))
    message = error["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}" if param else message, param=param or None)


def _path(prefix: str, loc: tuple[int | str, ...]) -> str:
    """``messages[0].role`` from pydantic's location (union branch tags dropped)."""
    text = prefix
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in ("str", "list[dict[str,any]]", "list[str]") or "[" in part:
            continue  # which branch of a union pydantic tried
        else:
            text += f".{part}" if text else part
    return text
