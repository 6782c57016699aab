"""Chat media (``ContentPart`` image, audio, video) across the data plane, as tensors go.

A chat message's media are bytes (``Media.data``) or PCM samples (``Media.pcm``,
a Tensor). Large ones must not need one large gRPC message, so the senders cut
them into TensorChunk messages sent first on the same stream (``Media.chunked``,
or ``pcm.chunked``), exactly like a large tensor; the receivers put them back
together from their stream's ``ChunkAssembler``, so the chunks count against the
same input byte budget as tensors' chunks. One walk over a StageInputs finds
every media message and names its field the way refusals name it
(``inputs.messages[1].parts[0].image``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from services.mesh.data.chunk_wire import EncodedChunk, encoded
from services.mesh.data.chunks import CHUNK_BYTES, ChunkAssembler
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2

MEDIA_KINDS = ("image", "audio", "video")  # ContentPart's media kinds, in field order


@dataclass(frozen=True)
class MediaField:
    """One media message inside a StageInputs, and where it is."""

    where: str  # e.g. "inputs.messages[1].parts[0].image"
    kind: str  # "image", "audio" or "video"
    media: stage_pb2.Media


def media_fields(inputs: stage_pb2.StageInputs, prefix: str = "inputs") -> Iterator[MediaField]:
    for m, message in enumerate(inputs.messages):
        for p, part in enumerate(message.parts):
            kind = part.WhichOneof("kind")
            if kind in MEDIA_KINDS:
                where = f"{prefix}.messages[{m}].parts[{p}].{kind}"
                yield MediaField(where, kind, getattr(part, kind))


def media_bytes(inputs: stage_pb2.StageInputs) -> int:
    """The inline bytes of every media part (encoded data and raw PCM)."""
    total = 0
    for item in media_fields(inputs):
        payload = item.media.WhichOneof("payload")
        if payload == "data":
            total += len(item.media.data)
        elif payload == "pcm" and item.media.pcm.WhichOneof("data") == "raw":
            total += len(item.media.pcm.raw)
    return total


def _inline(media: stage_pb2.Media) -> tuple[stage_pb2.Media | tensor_pb2.Tensor, bytes] | None:
    """The message holding ``media``'s inline bytes, and those bytes (taken once:
    protobuf hands out a new copy per access)."""
    payload = media.WhichOneof("payload")
    if payload == "data":
        return media, media.data
    if payload == "pcm" and media.pcm.WhichOneof("data") == "raw":
        return media.pcm, media.pcm.raw
    return None


def _cut(inputs: stage_pb2.StageInputs, threshold: int) -> list[tuple[str, bytes]]:
    """Every media's inline bytes over ``threshold`` moved out (its message says
    ``chunked`` now, in place): (chunk id, bytes) to send first, in order."""
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    out: list[tuple[str, bytes]] = []
    for item in media_fields(inputs):
        found = _inline(item.media)
        if found is None or len(found[1]) <= threshold:
            continue
        holder, raw = found
        chunk_id = uuid.uuid4().hex
        holder.chunked.CopyFrom(tensor_pb2.ChunkRef(chunk_id=chunk_id, nbytes=len(raw)))
        out.append((chunk_id, raw))
    return out


def split(
    inputs: stage_pb2.StageInputs, *, threshold: int = CHUNK_BYTES
) -> list[tensor_pb2.TensorChunk]:
    """Media over ``threshold`` bytes as TensorChunks (for a client's StreamInput)."""
    return [
        tensor_pb2.TensorChunk(
            chunk_id=chunk_id, offset=start, data=raw[start : start + threshold], total=len(raw)
        )
        for chunk_id, raw in _cut(inputs, threshold)
        for start in range(0, len(raw), threshold)
    ]


def split_encoded(
    inputs: stage_pb2.StageInputs, field: int, *, threshold: int = CHUNK_BYTES
) -> list[EncodedChunk]:
    """``split`` as stream frames (``chunk_wire``'s ``field``) written when sent."""
    return [
        frame
        for chunk_id, raw in _cut(inputs, threshold)
        for frame in encoded(field, chunk_id, memoryview(raw), threshold)
    ]


def resolve(chunks: ChunkAssembler, inputs: stage_pb2.StageInputs, prefix: str = "inputs") -> None:
    """Every chunked media given its bytes back (in place), from ``chunks``."""
    for item in media_fields(inputs, prefix):
        media = item.media
        payload = media.WhichOneof("payload")
        if payload == "chunked":
            media.data = bytes(chunks.take(media.chunked, item.where))
        elif payload == "pcm" and media.pcm.WhichOneof("data") == "chunked":
            media.pcm.raw = bytes(chunks.take(media.pcm.chunked, f"{item.where}.pcm"))
