from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.mesh.data.chunks import CHUNK_BYTES, ChunkAssembler, split
from services.mesh.errors import InvalidArgument, ResourceExhausted
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec

Mangle = Callable[[list[tensor_pb2.TensorChunk]], list[tensor_pb2.TensorChunk]]


def raw(nbytes: int, name: str = "t") -> tensor_pb2.Tensor:
    return codec.to_proto(torch.randint(0, 256, (nbytes,), dtype=torch.uint8), name)


@pytest.mark.parametrize(
    "nbytes",
    [CHUNK_BYTES + 1, 3 * CHUNK_BYTES, (4 << 20) + 3, (9 << 20) + 12345],
    ids=["one-over", "exact-multiple", "over-4MiB", "9MiB-odd"],
)
def test_split_and_assemble_round_trip(nbytes: int) -> None:
    original = [raw(100, "small"), raw(nbytes, "big"), raw(CHUNK_BYTES, "at-threshold")]
    sent = [tensor_pb2.Tensor.FromString(t.SerializeToString()) for t in original]
    chunks = split(sent)
    assert [t.WhichOneof("data") for t in sent] == ["raw", "chunked", "raw"]
    assert sent[1].chunked.nbytes == nbytes and sent[1].name == "big"
    assert len(chunks) == -(-nbytes // CHUNK_BYTES)  # no empty tail on exact multiples
    assert all(len(c.data) <= CHUNK_BYTES and c.total == nbytes for c in chunks)
    assert [c.offset for c in chunks] == [i * CHUNK_BYTES for i in range(len(chunks))]
    assert all(c.ByteSize() < 4 << 20 for c in chunks)  # fits a default gRPC client
    assembler = ChunkAssembler(max_pending_bytes=64 << 20)
    for chunk in chunks:
        assembler.add(tensor_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    assembler.resolve(sent, "inputs")
    assert sent == original
    assert assembler.pending_bytes == 0
    assert torch.equal(codec.from_proto(sent[1]), codec.from_proto(original[1]))


def test_chunk_ids_are_unique_and_refs_are_left_alone() -> None:
    shm = tensor_pb2.Tensor(dtype="uint8", shape=[1], shm=tensor_pb2.ShmRef(name="omni-m-1-1"))
    batch = [raw(10 << 10), raw(10 << 10), shm]
    chunks = split(batch, threshold=4 << 10)
    assert len({c.chunk_id for c in chunks}) == 2 and len(chunks) == 6
    assert batch[0].chunked.chunk_id != batch[1].chunked.chunk_id
    assert batch[2].WhichOneof("data") == "shm"


def chunks_of(
    nbytes: int, threshold: int = 1000
) -> tuple[tensor_pb2.Tensor, list[tensor_pb2.TensorChunk]]:
    tensor = raw(nbytes)
    return tensor, split([tensor], threshold=threshold)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda cs: [cs[0], cs[2]],  # one missing
        lambda cs: [cs[1]],  # starts in the middle
        lambda cs: [cs[0], cs[0]],  # repeated
        lambda cs: [
            cs[0],
            tensor_pb2.TensorChunk(chunk_id=cs[1].chunk_id, offset=1000, data=b"x", total=9),
        ],
        lambda cs: [
            cs[0],
            cs[1],
            tensor_pb2.TensorChunk(
                chunk_id=cs[2].chunk_id, offset=2000, data=b"x" * 999, total=2500
            ),
        ],
        lambda cs: [tensor_pb2.TensorChunk(chunk_id="", offset=0, data=b"x", total=1)],
    ],
    ids=["gap", "late-start", "repeat", "total-changes", "past-total", "no-id"],
)
def test_malformed_chunk_streams_are_refused(mangle: Mangle) -> None:
    _, chunks = chunks_of(2500)
    assembler = ChunkAssembler(max_pending_bytes=1 << 20)
    with pytest.raises(InvalidArgument) as err:
        for chunk in mangle(chunks):
            assembler.add(chunk)
    assert err.value.field == "chunk"


def test_incomplete_or_unknown_refs_name_the_tensor_and_change_nothing() -> None:
    done, done_chunks = chunks_of(1500)
    partial, partial_chunks = chunks_of(2500)
    assembler = ChunkAssembler(max_pending_bytes=1 << 20)
    for chunk in [*done_chunks, *partial_chunks[:2]]:
        assembler.add(chunk)
    batch = [done, partial]
    before = [t.SerializeToString() for t in batch]
    with pytest.raises(InvalidArgument) as err:
        assembler.resolve(batch, "segment.tensors")
    assert err.value.field == "segment.tensors[1]" and "2000 of 2500" in err.value.message
    assert [t.SerializeToString() for t in batch] == before
    unknown = tensor_pb2.Tensor(
        dtype="uint8", shape=[3], chunked=tensor_pb2.ChunkRef(chunk_id="zz", nbytes=3)
    )
    with pytest.raises(InvalidArgument) as err:
        assembler.resolve([unknown], "x")
    assert err.value.field == "x[0]"
    assembler.add(partial_chunks[2])
    partial.chunked.nbytes = 7
    with pytest.raises(InvalidArgument, match="nbytes 7"):
        assembler.resolve(batch, "segment.tensors")
    partial.chunked.nbytes = 2500
    twice = tensor_pb2.Tensor.FromString(partial.SerializeToString())
    with pytest.raises(InvalidArgument, match="referenced twice"):
        assembler.resolve([partial, twice], "segment.tensors")
    assembler.resolve(batch, "segment.tensors")
    assert [len(t.raw) for t in batch] == [1500, 2500]


def test_pending_bytes_are_bounded_and_freed() -> None:
    _, first = chunks_of(3000)
    _, second = chunks_of(3000)
    assembler = ChunkAssembler(max_pending_bytes=5000)
    assembler.add(first[0])
    assert assembler.pending_bytes == 3000  # reserved by the declared total
    with pytest.raises(ResourceExhausted):
        assembler.add(second[0])
    # A lying total is refused before anything is kept.
    with pytest.raises(ResourceExhausted):
        assembler.add(tensor_pb2.TensorChunk(chunk_id="huge", offset=0, data=b"x", total=1 << 40))
    assert assembler.pending_bytes == 3000
    assembler.discard_all()
    assert assembler.pending_bytes == 0
    for chunk in second:
        assembler.add(chunk)
    assert assembler.pending_bytes == 3000
