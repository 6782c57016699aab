"""A chat's content parts read into ``ChatTurn``s, and refused by name where wrong.

Each ``ChatMessage`` is text (``content``) or an ordered list of parts (text,
image, audio, video: stage.proto ``ContentPart``). Before any media is decoded,
every part's kind is checked against what the stage's engine takes (its
``accepts``), so an audio clip sent to a stage that reads text and images is
refused at once, in the words a user can act on: "stage thinker takes text and
image, not audio". Then each part is checked (a known media type for its kind,
bytes present, PCM as float32 [samples] with a sample rate) and decoded: chunked
bytes are taken whole from the stream's assembler, as a chunked tensor's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.engines.base import ChatTurn, ContentPart, MediaPart
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.errors import InvalidArgument
from services.mesh.media_types import MEDIA_TYPES, PCM, canonical, refuse_kinds
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.tensors.transport import TensorReceiver

TEXT_JOIN = "\n"  # between a message's text parts, in its ``content`` (as vLLM joins them)


@dataclass(frozen=True)
class Intake:
    """Who is reading: the stage's name and the kinds its engine takes."""

    stage: str
    accepts: frozenset[str]


def _invalid(where: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {why}", field=where)


def check_kinds(messages: Sequence[stage_pb2.ChatMessage], intake: Intake) -> None:
    """Refuse the first part of a kind the engine does not take (before any decoding)."""
    refuse_kinds(messages, intake.accepts, intake.stage)


def read_messages(
    messages: Sequence[stage_pb2.ChatMessage],
    receiver: TensorReceiver,
    chunks: ChunkAssembler | None,
    *,
    request_id: str,
) -> tuple[tuple[tuple[str, str], ...], tuple[ChatTurn, ...]]:
    """The chat as (role, text) pairs, and as turns with their parts when any message
    has media (else no turns: text-only engines and requests are as before)."""
    turns: list[ChatTurn] = []
    for m, message in enumerate(messages):
        where = f"inputs.messages[{m}]"
        if not message.role:
            raise _invalid(f"{where}.role", "must not be empty")
        if message.parts and message.content:
            raise _invalid(
                f"{where}.content",
                "set content (text) or parts (text and media), not both",
            )
        parts = tuple(
            _part(part, f"{where}.parts[{p}]", receiver, chunks, request_id)
            for p, part in enumerate(message.parts)
        )
        text = TEXT_JOIN.join(p for p in parts if isinstance(p, str)) if parts else message.content
        # A message without media is its text alone, however it was sent (ChatTurn).
        media = any(isinstance(p, MediaPart) for p in parts)
        turns.append(ChatTurn(message.role, text, parts if media else ()))
    pairs = tuple((t.role, t.content) for t in turns)
    return pairs, tuple(turns) if any(t.parts for t in turns) else ()


def _part(
    part: stage_pb2.ContentPart,
    where: str,
    receiver: TensorReceiver,
    chunks: ChunkAssembler | None,
    request_id: str,
) -> ContentPart:
    kind = part.WhichOneof("kind")
    if kind is None:
        raise _invalid(where, "an empty part: set one of text, image, audio, video")
    if kind == "text":
        return part.text
    media: stage_pb2.Media = getattr(part, kind)
    where = f"{where}.{kind}"
    payload = media.WhichOneof("payload")
    if payload == "pcm":
        return _pcm(media, kind, where, receiver, chunks, request_id)
    media_type = canonical(media.media_type)
    known = MEDIA_TYPES[kind] - {PCM}
    if media_type not in known:
        said = f"{media.media_type!r} is not" if media.media_type else "empty; expected"
        why = f"{said} one of {', '.join(sorted(known))}"
        if media_type == PCM:
            why = f"{PCM} is sent as pcm samples with a sample_rate, not as data"
        raise _invalid(f"{where}.media_type", why)
    if media.sample_rate:
        raise _invalid(f"{where}.sample_rate", "only pcm audio has a sample rate")
    if payload == "chunked":
        if chunks is None:
            raise _invalid(f"{where}.chunked", "chunked bytes need their TensorChunks first")
        data = bytes(chunks.take(media.chunked, where))
    else:
        data = media.data
    if not data:
        raise _invalid(f"{where}.data", "empty: the encoded file's bytes are missing")
    return MediaPart(kind, media_type, data)


def _pcm(
    media: stage_pb2.Media,
    kind: str,
    where: str,
    receiver: TensorReceiver,
    chunks: ChunkAssembler | None,
    request_id: str,
) -> MediaPart:
    if kind != "audio":
        raise _invalid(f"{where}.pcm", f"only audio carries pcm samples, not {kind}")
    if media.media_type and canonical(media.media_type) != PCM:
        raise _invalid(f"{where}.media_type", f"pcm samples are {PCM}, not {media.media_type!r}")
    if media.sample_rate <= 0:
        raise _invalid(f"{where}.sample_rate", "pcm needs its sample rate (> 0)")
    field = f"{where}.pcm"
    if media.pcm.dtype != "float32":
        raise _invalid(f"{field}.dtype", f"expected float32 samples, got {media.pcm.dtype!r}")
    if len(media.pcm.shape) != 1 or media.pcm.shape[0] <= 0:
        raise _invalid(f"{field}.shape", f"expected [samples] (mono), got {list(media.pcm.shape)}")
    try:
        samples = receiver.decode(media.pcm, field, chunks, request_id=request_id)
    except (RuntimeError, ValueError, OverflowError) as exc:
        raise _invalid(f"{field}.shape", f"cannot be decoded ({exc})") from None
    return MediaPart("audio", PCM, pcm=samples, sample_rate=media.sample_rate)
