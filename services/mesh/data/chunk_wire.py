"""TensorChunk stream messages encoded and decoded by hand, for the bytes path.

A chunk is a StageInput (field 3) or StageOutput (field 5) holding one
TensorChunk; the protobuf library would copy its payload three times on the way
out (slice, message field, serialization) and twice on the way in (parse, field
access) before it reaches the assembler's buffer. Here the frame is written in
one join straight from the tensor's memory, and read as a view of the received
frame that the assembler copies once into its destination.

The wire format is exactly the protobuf contract (protos/omni/v1): an encoded
frame is byte for byte what ``SerializeToString`` gives for the same message,
and the decoder accepts any valid encoding of a lone chunk (fields in any order,
repeated scalars, unknown fields). A frame it does not recognise as one goes to
the regular parser, so other messages and malformed frames behave as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STAGE_INPUT_CHUNK = 3  # StageInput.chunk
STAGE_OUTPUT_CHUNK = 5  # StageOutput.chunk
_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
_U64 = 1 << 64


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


@dataclass(frozen=True)
class EncodedChunk:
    """One chunk message, still a view of its tensor's bytes: ``encode`` writes the
    frame (one copy) when the stream sends it, so pieces are cut one at a time."""

    field: int  # STAGE_INPUT_CHUNK or STAGE_OUTPUT_CHUNK
    chunk_id: str
    offset: int
    total: int
    data: memoryview  # flat bytes

    def encode(self) -> bytes:
        # Fields in number order and zeros left out, as SerializeToString writes them.
        head = bytearray()
        if self.chunk_id:
            cid = self.chunk_id.encode()
            head += _key(1, _LEN) + _varint(len(cid)) + cid
        if self.offset:
            head += _key(2, _VARINT) + _varint(self.offset)
        nbytes = self.data.nbytes
        if nbytes:
            head += _key(3, _LEN) + _varint(nbytes)
        tail = _key(4, _VARINT) + _varint(self.total) if self.total else b""
        inner = len(head) + nbytes + len(tail)
        outer = _key(self.field, _LEN) + _varint(inner)
        return b"".join((outer, head, self.data, tail))


def encoded(field: int, chunk_id: str, data: memoryview, threshold: int) -> list[EncodedChunk]:
    """The chunks of ``data`` (flat bytes), ``threshold`` bytes each, none copied yet."""
    total = data.nbytes
    return [
        EncodedChunk(field, chunk_id, start, total, data[start : start + threshold])
        for start in range(0, total, threshold)
    ]


@dataclass(frozen=True)
class WireChunk:
    """A received TensorChunk; ``data`` is a view of the frame it came in."""

    chunk_id: str
    offset: int
    total: int
    data: memoryview


@dataclass(frozen=True)
class ChunkFrame:
    """A received StageInput or StageOutput that holds a chunk: read as the message
    is where the stream's readers look (``WhichOneof``, ``HasField``, ``chunk``)."""

    chunk: WireChunk

    def WhichOneof(self, oneof: str) -> str:  # the protobuf method's name
        return "chunk"

    def HasField(self, name: str) -> bool:
        return name == "chunk"


class _Unrecognised(Exception):
    """Not a lone chunk this decoder reads: the regular parser decides."""


def _read_varint(frame: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 70:
        byte = frame[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >= _U64:
                raise _Unrecognised
            return value, pos
        shift += 7
    raise _Unrecognised


def _parse_chunk(frame: memoryview, pos: int, end: int) -> WireChunk:
    chunk_id, offset, total = "", 0, 0
    data = frame[pos:pos]
    while pos < end:
        key, pos = _read_varint(frame, pos, end)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(frame, pos, end)
            if field == 2:
                offset = value
            elif field == 4:
                total = value
            elif field in (1, 3):
                raise _Unrecognised  # a known field of the wrong type
        elif wire_type == _LEN:
            size, pos = _read_varint(frame, pos, end)
            if pos + size > end:
                raise _Unrecognised
            if field == 1:
                chunk_id = bytes(frame[pos : pos + size]).decode()  # strict UTF-8, as protobuf
            elif field == 3:
                data = frame[pos : pos + size]
            elif field in (2, 4):
                raise _Unrecognised
            pos += size
        elif wire_type in (_I64, _I32) and field > 4:
            pos += 8 if wire_type == _I64 else 4
        else:
            raise _Unrecognised  # groups, or a known field of the wrong type
        if field == 0 or pos > end:
            raise _Unrecognised
    return WireChunk(chunk_id, offset, total, data)


def decode_chunk(frame: bytes, field: int) -> ChunkFrame | None:
    """The chunk a frame that is exactly one ``field`` (a TensorChunk) holds, or
    None when the frame is anything else."""
    view = memoryview(frame)
    try:
        key, pos = _read_varint(view, 0, len(view))
        if key != (field << 3 | _LEN):
            return None
        size, pos = _read_varint(view, pos, len(view))
        if pos + size != len(view):
            return None  # other top-level fields too: the regular parser merges them
        return ChunkFrame(_parse_chunk(view, pos, pos + size))
    except (_Unrecognised, UnicodeDecodeError):
        return None


def deserializer(field: int, regular: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A gRPC deserializer: chunks read by hand, every other frame by ``regular``."""

    def decode(frame: bytes) -> Any:
        fast = decode_chunk(frame, field)
        return fast if fast is not None else regular(frame)

    return decode


def serializer(regular: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A gRPC serializer: an EncodedChunk writes itself, a message as ``regular``."""

    def encode(message: Any) -> bytes:
        if isinstance(message, EncodedChunk):
            return message.encode()
        return regular(message)

    return encode
