"""Chunk frames encoded and read by hand (chunk_wire) are the protobuf contract:
what the encoder writes is byte for byte SerializeToString and parses back with
the regular FromString; the decoder reads any valid encoding of a lone chunk
(fields reordered, repeated, unknown) to what FromString reads, and leaves
every frame it does not recognise to the regular parser."""

from __future__ import annotations

import random

import pytest

from services.mesh.data.chunk_wire import (
    STAGE_INPUT_CHUNK,
    STAGE_OUTPUT_CHUNK,
    ChunkFrame,
    EncodedChunk,
    decode_chunk,
    deserializer,
    encoded,
    serializer,
)
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2

KINDS = [(STAGE_INPUT_CHUNK, stage_pb2.StageInput), (STAGE_OUTPUT_CHUNK, stage_pb2.StageOutput)]
CASES = [
    ("abc", 0, b"", 0),  # every scalar at its default: left out, as protobuf does
    ("ab12", 0, b"x", 1),
    ("é-ünïcode", 1 << 20, bytes(range(256)) * 7, 3 << 30),
    ("", 5, b"\x00" * 300, 305),
    ("big", (1 << 64) - 1, b"\xff" * 128, (1 << 64) - 1),  # 10-byte varints
]


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def field(number: int, wire_type: int, payload: bytes | int) -> bytes:
    key = varint(number << 3 | wire_type)
    if wire_type == 0:
        assert isinstance(payload, int)
        return key + varint(payload)
    assert isinstance(payload, bytes)
    return key + (varint(len(payload)) if wire_type == 2 else b"") + payload


def frame(outer: int, inner: bytes) -> bytes:
    return field(outer, 2, inner)


@pytest.mark.parametrize(("outer", "message"), KINDS)
@pytest.mark.parametrize(("chunk_id", "offset", "data", "total"), CASES)
def test_an_encoded_chunk_is_what_protobuf_writes(
    outer: int, message: type, chunk_id: str, offset: int, data: bytes, total: int
) -> None:
    chunk = tensor_pb2.TensorChunk(chunk_id=chunk_id, offset=offset, data=data, total=total)
    regular = message(chunk=chunk)
    mine = EncodedChunk(outer, chunk_id, offset, total, memoryview(data)).encode()
    assert mine == regular.SerializeToString()
    assert message.FromString(mine) == regular
    got = decode_chunk(mine, outer)
    assert got is not None and got.WhichOneof("kind") == "chunk" and got.HasField("chunk")
    assert (got.chunk.chunk_id, got.chunk.offset, got.chunk.total) == (chunk_id, offset, total)
    assert bytes(got.chunk.data) == data


def test_encoded_pieces_cover_the_data_and_reassemble() -> None:
    data = bytes(random.Random(1).randbytes(10_000))
    pieces = encoded(STAGE_OUTPUT_CHUNK, "t", memoryview(data), 3000)
    assert [p.offset for p in pieces] == [0, 3000, 6000, 9000]
    assembler = ChunkAssembler(1 << 20)
    for piece in pieces:
        parsed = stage_pb2.StageOutput.FromString(piece.encode())  # what another client reads
        assert parsed.chunk.total == len(data)
        fast = decode_chunk(piece.encode(), STAGE_OUTPUT_CHUNK)
        assert fast is not None
        assembler.add(fast.chunk)
    taken = assembler.take(tensor_pb2.ChunkRef(chunk_id="t", nbytes=len(data)), "t")
    assert bytes(taken) == data


def equivalent(got: ChunkFrame, regular: tensor_pb2.TensorChunk) -> bool:
    return (got.chunk.chunk_id, got.chunk.offset, got.chunk.total, bytes(got.chunk.data)) == (
        regular.chunk_id,
        regular.offset,
        regular.total,
        regular.data,
    )


@pytest.mark.parametrize(("outer", "message"), KINDS)
def test_any_valid_encoding_reads_as_protobuf_reads_it(outer: int, message: type) -> None:
    rng = random.Random(outer)
    for _ in range(300):
        fields = [
            field(1, 2, rng.choice(["a", "id-ü", ""]).encode()),
            field(2, 0, rng.randrange(1 << rng.choice([1, 7, 35, 64]))),
            field(3, 2, rng.randbytes(rng.randrange(0, 200))),
            field(4, 0, rng.randrange(1 << 40)),
        ]
        # Scalars repeated (the last one counts), unknown fields of every wire type.
        fields += rng.sample(fields, rng.randrange(0, 3))
        fields += rng.sample(
            [
                field(9, 0, 12345),
                field(10, 2, b"unknown bytes"),
                field(11, 1, b"8bytes!!"),
                field(12, 5, b"4byt"),
                field(2000, 0, 1),
            ],
            rng.randrange(0, 4),
        )
        rng.shuffle(fields)
        data = frame(outer, b"".join(fields))
        got = decode_chunk(data, outer)
        assert got is not None, data
        regular = message.FromString(data)
        assert equivalent(got, regular.chunk)


@pytest.mark.parametrize(("outer", "message"), KINDS)
def test_what_it_does_not_recognise_goes_to_the_regular_parser(outer: int, message: type) -> None:
    chunk = frame(outer, field(1, 2, b"id") + field(3, 2, b"data") + field(4, 0, 4))
    others = [
        message(credit=stage_pb2.Credit(request_id="r", outputs=3)).SerializeToString()
        if outer == STAGE_INPUT_CHUNK
        else message(segment=stage_pb2.Segment(request_id="r")).SerializeToString(),
        chunk + chunk,  # two chunk fields: protobuf merges them
        frame(outer, field(1, 0, 5)),  # chunk_id with a varint's wire type
        frame(outer, field(7, 3, b"")),  # a group
        frame(outer, field(1, 2, b"\xff\xfe")),  # bad UTF-8: the regular parser refuses it
        frame(outer, field(3, 2, b"abc")[:-1]),  # the payload runs past the frame
        chunk[:-1],
        b"",
    ]
    decode = deserializer(outer, lambda raw: ("regular", raw))
    for other in others:
        assert decode_chunk(other, outer) is None, other
        assert decode(other) == ("regular", other)
    fast = decode(chunk)
    assert isinstance(fast, ChunkFrame) and bytes(fast.chunk.data) == b"data"


@pytest.mark.parametrize(("outer", "message"), KINDS)
def test_a_frame_read_by_hand_always_parses_the_same_with_protobuf(
    outer: int, message: type
) -> None:
    # Corrupted frames: whenever the hand decoder accepts one, protobuf reads it the same.
    rng = random.Random(7 + outer)
    base = EncodedChunk(outer, "chunk", 77, 1000, memoryview(b"payload" * 9)).encode()
    for _ in range(2000):
        mutated = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        got = decode_chunk(bytes(mutated), outer)
        if got is None:
            continue
        regular = message.FromString(bytes(mutated))  # must not raise
        assert regular.WhichOneof("kind") == "chunk"
        assert equivalent(got, regular.chunk)


def test_the_serializer_passes_messages_to_protobuf() -> None:
    encode = serializer(stage_pb2.StageOutput.SerializeToString)
    segment = stage_pb2.StageOutput(segment=stage_pb2.Segment(request_id="r", token_ids=[1, 2]))
    assert encode(segment) == segment.SerializeToString()
    chunk = EncodedChunk(STAGE_OUTPUT_CHUNK, "c", 0, 3, memoryview(b"abc"))
    assert isinstance(encode(chunk), bytes) and encode(chunk) == chunk.encode()
