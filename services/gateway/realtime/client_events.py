"""The client events a realtime session takes (GA names), each validated once
into its model; an event that does not validate is answered with an ``error``
naming its field as the client spelt it (``item.content[0].audio``), and the
session goes on. Events the mesh cannot serve are refused by name (REFUSED).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.errors import ApiError
from services.gateway.schema import validate


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: str | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: dict[str, Any]


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ContentPart(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text", "audio"]
    text: str | None = None
    audio: str | None = None  # base64 16-bit PCM at 24 kHz
    transcript: str | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["message"] = "message"
    id: str | None = Field(None, min_length=1, max_length=64)
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart] = Field(min_length=1)


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: dict[str, Any]


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ResponseAudio(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    output: dict[str, Any] = {}


class ResponseParams(BaseModel):
    """``response.create``'s ``response``: this response's own settings over the session's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = Field(
        None, min_length=1, max_length=1
    )
    max_output_tokens: int | Literal["inf"] | None = None
    audio: ResponseAudio | None = None
    metadata: dict[str, str] | None = None
    conversation: Literal["auto"] | None = None  # "none" (out of band) is refused
    tools: list[None] | None = Field(None, max_length=0)
    tool_choice: Literal["auto", "none"] | None = None

    @field_validator("max_output_tokens")
    @classmethod
    def _positive(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError("expected a positive number of tokens, or 'inf'")
        return value


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParams = ResponseParams()


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


Event = (
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ItemRetrieve
    | ItemDelete
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel
)
MODELS: dict[str, type[_Event]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": AudioAppend,
    "input_audio_buffer.commit": AudioCommit,
    "input_audio_buffer.clear": AudioClear,
    "conversation.item.create": ItemCreate,
    "conversation.item.retrieve": ItemRetrieve,
    "conversation.item.delete": ItemDelete,
    "conversation.item.truncate": ItemTruncate,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}
REFUSED = {
    "output_audio_buffer.clear": "the output audio buffer exists over WebRTC only; this "
    "session is a WebSocket (use response.cancel)",
    "transcription_session.update": "transcription sessions are not served",
}


class EventError(ApiError):
    """A client event refused: the ``error`` event names its field and echoes its id."""

    def __init__(self, error: ApiError, event_id: str | None) -> None:
        super().__init__(400, error.message, param=error.param, code=error.code or "invalid_event")
        self.event_id = event_id


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def parse(text: str | bytes) -> Event:
    """One WebSocket message as its client event; EventError naming the field."""
    try:
        raw = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise EventError(
            ApiError(400, f"not valid JSON: {exc}", code="invalid_json"), None
        ) from None
    if not isinstance(raw, dict):
        raise EventError(
            ApiError(400, "expected a JSON object (an event)", code="invalid_event"), None
        )
    event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    kind = raw.get("type")
    model = MODELS.get(kind) if isinstance(kind, str) else None
    try:
        if model is None:
            if isinstance(kind, str) and kind in REFUSED:
                raise bad("type", f"{kind!r}: {REFUSED[kind]}", "unsupported_event")
            known = ", ".join(MODELS)
            raise bad("type", f"unknown event type {kind!r} (known: {known})", "invalid_event_type")
        event: Event = validate(model, raw)  # type: ignore[assignment]
    except ApiError as exc:
        raise EventError(exc, event_id) from None
    return event


def pcm(text: str, param: str, limit: int) -> bytes:
    """Base64 16-bit PCM, checked: valid base64, whole samples, within ``limit`` bytes."""
    if len(text) > (limit + 2) // 3 * 4:  # refused before decoding a flood
        raise bad(param, f"over {limit} bytes of audio", "audio_too_large")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, "not valid base64", "invalid_base64") from None
    if len(data) % 2:
        raise bad(param, "16-bit PCM has an even number of bytes", "invalid_audio_format")
    return data
