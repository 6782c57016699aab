"""OpenAI chat content parts as the mesh's ``ContentPart``s (stage.proto).

    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav" | "mp3"}}

Images come as data URLs only: the gateway never fetches a URL (an http(s) URL
is a 400 naming ``messages[i].content[j].image_url.url``), so a request cannot
make the gateway reach into the network it sits in. A string ``content`` stays a
string, as every client before content parts sent it. Whether a stage takes
images or audio is the stage's to say: it refuses by name, and the error's field
is mapped back to the part here (``fields``).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from services.gateway.errors import ApiError
from services.gateway.schema import ChatRequest, Message, TextPart, validate
from services.mesh import media_types
from services.mesh.pb.omni.v1 import stage_pb2

_AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg"}


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ImageUrl(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model decides


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Body):
    data: str
    format: Literal["wav", "mp3"]


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


def _bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param)


def _base64(text: str, param: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(param, "not valid base64") from None
    if not data:
        raise _bad(param, "empty")
    return data


def _data_url(url: str, param: str) -> tuple[str, bytes]:
    """(media type, bytes) of a ``data:<type>;base64,<data>`` URL."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise _bad(param, "the gateway does not fetch URLs; send the image as a data URL "
                          "(data:image/png;base64,...)")  # fmt: skip
    head, comma, payload = url.partition(",")
    if scheme != "data" or not comma or not head.endswith(";base64"):
        raise _bad(param, "expected a data URL: data:<media type>;base64,<data>")
    media_type = media_types.canonical(head[len("data:") : -len(";base64")])
    if media_types.kind_of(media_type) != "image" or media_type == media_types.PCM:
        known = ", ".join(sorted(media_types.MEDIA_TYPES["image"]))
        raise _bad(param, f"{media_type or 'no media type'} is not an image type ({known})")
    return media_type, _base64(payload, param)


def _part(part: dict[str, Any], where: str) -> stage_pb2.ContentPart:
    kind = part.get("type")
    if kind == "text":
        return stage_pb2.ContentPart(text=validate(TextPart, part, prefix=where).text)
    # Filled field by field: a constructor given a Media re-encodes its bytes (upb).
    out = stage_pb2.ContentPart()
    if kind == "image_url":
        url = validate(ImagePart, part, prefix=where).image_url.url
        out.image.media_type, out.image.data = _data_url(url, f"{where}.image_url.url")
        return out
    if kind == "input_audio":
        audio = validate(AudioPart, part, prefix=where).input_audio
        out.audio.media_type = _AUDIO_FORMATS[audio.format]
        out.audio.data = _base64(audio.data, f"{where}.input_audio.data")
        return out
    raise ApiError(
        400,
        f"{where}.type: expected text, image_url or input_audio, got {kind!r}",
        param=f"{where}.type",
        code="unsupported_content",
    )


def chat_message(role: str, message: Message, index: int) -> stage_pb2.ChatMessage:
    """``message`` (the request's ``messages[index]``) for the mesh."""
    if message.content is None or isinstance(message.content, str):
        return stage_pb2.ChatMessage(role=role, content=message.content or "")
    where = f"messages[{index}].content"
    out = stage_pb2.ChatMessage(role=role)
    for j, part in enumerate(message.content):
        out.parts.add().CopyFrom(_part(part, f"{where}[{j}]"))
    return out


def fields(chat: ChatRequest) -> dict[str, str]:
    """The mesh's field of each part -> the request's, for errors that name a part."""
    return {
        f"inputs.messages[{i}].parts[{j}]": f"messages[{i}].content[{j}]"
        for i, message in enumerate(chat.messages)
        if isinstance(message.content, list)
        for j in range(len(message.content))
    }
