"""Chat content parts as a client builds them: text, an image, an audio clip (a file's
bytes or PCM samples), a video, from bytes or from a file on disk.

    message = chat_message("user", image_file(Path("cat.png")), "What is this?")
    client.generate(inputs=stage_pb2.StageInputs(messages=[message]))

or, for the common case, ``client.generate("What is this?", media=[image_file(...)])``.
A request whose media would make a large message is sent by the clients as
TensorChunks on GenerateStream (``needs_stream``), so no size needs one big message.

Parts are filled field by field and copied with ``CopyFrom``: protobuf's (upb)
constructor with a sub-message, ``append`` and ``MergeFrom`` copy a message by
re-encoding it, many times slower for megabytes of bytes (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path

from services.mesh import media_types
from services.mesh.data import media_wire
from services.mesh.data.chunks import CHUNK_BYTES
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2


class MediaFileError(ValueError):
    """A media file that cannot be sent (unreadable, or of no known type); names the file."""


def media_part(kind: str, data: bytes, media_type: str) -> stage_pb2.ContentPart:
    """An image, audio or video part from a file's bytes and their media type."""
    if kind not in media_wire.MEDIA_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(media_wire.MEDIA_KINDS)}, got {kind!r}")
    part = stage_pb2.ContentPart()
    media = getattr(part, kind)
    media.media_type = media_type
    media.data = data
    return part


def image(data: bytes, media_type: str) -> stage_pb2.ContentPart:
    return media_part("image", data, media_type)


def audio(data: bytes, media_type: str) -> stage_pb2.ContentPart:
    return media_part("audio", data, media_type)


def pcm(samples: bytes | Iterable[float], sample_rate: int) -> stage_pb2.ContentPart:
    """Mono audio as samples in [-1, 1]: float32 little-endian bytes, or numbers."""
    if isinstance(samples, bytes | bytearray | memoryview):
        raw = bytes(samples)
    else:
        values = array("f", samples)
        if sys.byteorder == "big":
            values.byteswap()
        raw = values.tobytes()
    part = stage_pb2.ContentPart()
    part.audio.media_type, part.audio.sample_rate = media_types.PCM, sample_rate
    tensor: tensor_pb2.Tensor = part.audio.pcm
    tensor.name, tensor.dtype, tensor.raw = "pcm", "float32", raw
    tensor.shape.append(len(raw) // 4)
    return part


def media_file(kind: str, path: Path) -> stage_pb2.ContentPart:
    """A file as a part of ``kind``; its media type from its first bytes or its suffix."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise MediaFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    media_type = media_types.of_file(path, data)
    if media_type is None or media_types.kind_of(media_type) != kind:
        known = ", ".join(sorted(media_types.MEDIA_TYPES[kind] - {media_types.PCM}))
        said = f"a {media_type} file" if media_type else "of no known type"
        raise MediaFileError(f"{path}: {said}, not {kind} ({known})")
    return media_part(kind, data, media_type)


def image_file(path: Path) -> stage_pb2.ContentPart:
    return media_file("image", path)


def audio_file(path: Path) -> stage_pb2.ContentPart:
    return media_file("audio", path)


def files(images: Sequence[Path] = (), audios: Sequence[Path] = ()) -> list[stage_pb2.ContentPart]:
    """``omni generate --image A --audio B``: the parts, images first, in the order given."""
    return [*(image_file(p) for p in images), *(audio_file(p) for p in audios)]


def chat_message(role: str, *parts: str | stage_pb2.ContentPart) -> stage_pb2.ChatMessage:
    """A message of text and media in order (a lone text is sent as plain ``content``)."""
    return fill(stage_pb2.ChatMessage(role=role), *parts)


def fill(
    message: stage_pb2.ChatMessage, *parts: str | stage_pb2.ContentPart
) -> stage_pb2.ChatMessage:
    """``message`` given ``parts`` in place: a message already inside a request is
    filled where it is, as each copy of a large part costs (protobuf copies bytes)."""
    if len(parts) == 1 and isinstance(parts[0], str):
        message.content = parts[0]
        return message
    for part in parts:
        if isinstance(part, str):
            message.parts.add(text=part)
        else:
            message.parts.add().CopyFrom(part)
    return message


def needs_stream(inputs: stage_pb2.StageInputs, threshold: int = CHUNK_BYTES) -> bool:
    """Media over one chunk: send the request by GenerateStream, the media in chunks."""
    return media_wire.media_bytes(inputs) > threshold
