"""Inline tensor and blob bytes across several stream messages, so any size fits.

gRPC clients refuse messages over 4 MiB by default; rather than ask every client
to raise that limit, a large raw tensor (or blob, e.g. a PNG) travels as
TensorChunk messages (each at most CHUNK_BYTES) followed by the message whose
tensor (or blob) says ``chunked``.

The receiver writes each chunk into one destination buffer made when the first
chunk arrives (huge pages when large: a fresh 64 MiB buffer otherwise costs
more in page faults than the copy itself), so chunks are never joined; a stage
decodes a tensor straight from that buffer (``take``), without another copy.
"""

from __future__ import annotations

import mmap
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from services.mesh.data.chunk_wire import EncodedChunk, encoded
from services.mesh.errors import InvalidArgument, ResourceExhausted
from services.mesh.pb.omni.v1 import tensor_pb2

# 1 MiB, chosen with benchmarks/transport.py --chunk-sweep (64 MiB through a
# real gRPC stream between two processes, the mesh's own encode and decode at
# both ends, transports in a new random order each round; figures in
# docs/benchmarks.md): 1, 2 and 4 MiB are level within the noise, smaller chunks
# pay gRPC's cost per message, and 4 MiB and more gain nothing while a 4 MiB chunk
# no longer fits the 4 MiB message a default gRPC client accepts. Smaller chunks
# also interleave better with other requests' messages on a shared stream. The
# sweep held once chunks were encoded and read by hand (chunk_wire).
CHUNK_BYTES = 1 << 20
M = TypeVar("M")
# Destinations from this size up are anonymous mappings advised to use huge pages.
_HUGE_BYTES = 2 << 20
# Refused chunk ids remembered per stream, so the rest of a refused tensor's chunks
# are dropped quietly and its Submit learns why (bounded: a flood of ids is not kept).
_REFUSED_KEPT = 64


class Reservations(Protocol):
    """A budget the chunks held also count against (the stage's per-process cap)."""

    def reserve(self, nbytes: int, field: str) -> None:
        """Charge ``nbytes`` or raise ResourceExhausted (nothing charged)."""
        ...

    def release(self, nbytes: int) -> None: ...


def split(
    tensors: MutableSequence[tensor_pb2.Tensor], *, threshold: int = CHUNK_BYTES
) -> list[tensor_pb2.TensorChunk]:
    """Move the bytes of every raw tensor over ``threshold`` into chunks, in place.

    Returns the chunks to send, in order, before the message holding ``tensors``.
    """
    return _split(tensors, "data", "raw", threshold)


def split_blobs(
    blobs: MutableSequence[tensor_pb2.Blob], *, threshold: int = CHUNK_BYTES
) -> list[tensor_pb2.TensorChunk]:
    """``split`` for blobs: the bytes of every blob over ``threshold`` become chunks."""
    return _split(blobs, "payload", "data", threshold)


def split_encoded(
    tensors: MutableSequence[tensor_pb2.Tensor],
    blobs: MutableSequence[tensor_pb2.Blob],
    field: int,
    *,
    threshold: int = CHUNK_BYTES,
) -> list[EncodedChunk]:
    """``split`` and ``split_blobs`` as stream messages (``chunk_wire``'s ``field``)
    encoded by hand when sent: the bytes are taken out of each message once and
    every frame is written straight from them."""
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    out: list[EncodedChunk] = []
    pairs: list[tuple[Sequence[tensor_pb2.Tensor | tensor_pb2.Blob], str, str]] = [
        (tensors, "data", "raw"),
        (blobs, "payload", "data"),
    ]
    for messages, oneof, inline in pairs:
        for message in messages:
            if message.WhichOneof(oneof) != inline:
                continue
            raw = getattr(message, inline)  # a new copy per access: take it once
            if len(raw) <= threshold:
                continue
            chunk_id = uuid.uuid4().hex
            out += encoded(field, chunk_id, memoryview(raw), threshold)
            message.chunked.CopyFrom(tensor_pb2.ChunkRef(chunk_id=chunk_id, nbytes=len(raw)))
    return out


def _split(
    messages: Sequence[tensor_pb2.Tensor | tensor_pb2.Blob], oneof: str, inline: str, threshold: int
) -> list[tensor_pb2.TensorChunk]:
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    chunks: list[tensor_pb2.TensorChunk] = []
    for message in messages:
        if message.WhichOneof(oneof) != inline:
            continue
        raw = getattr(message, inline)  # protobuf hands out a new copy per access: take it once
        total = len(raw)
        if total <= threshold:
            continue
        chunk_id = uuid.uuid4().hex
        chunks += [
            tensor_pb2.TensorChunk(
                chunk_id=chunk_id, offset=start, data=raw[start : start + threshold], total=total
            )
            for start in range(0, total, threshold)
        ]
        message.chunked.CopyFrom(tensor_pb2.ChunkRef(chunk_id=chunk_id, nbytes=total))
    return chunks


@dataclass(frozen=True)
class Unsent:
    """A tensor's bytes still in its own memory, to go as TensorChunks cut one at a
    time as they are sent: no joined copy of the whole, and each piece is freed
    (and its memory reused warm) before the next is made."""

    chunk_id: str
    data: memoryview  # flat bytes
    threshold: int

    @property
    def ref(self) -> tensor_pb2.ChunkRef:
        return tensor_pb2.ChunkRef(chunk_id=self.chunk_id, nbytes=len(self.data))

    def messages(self, make: Callable[[], tuple[M, tensor_pb2.TensorChunk]]) -> Iterator[M]:
        """One stream message per piece, cut as it is asked for. ``make`` gives a new
        message and the TensorChunk inside it, filled in place (a chunk given to a
        message's constructor would be copied again)."""
        total = len(self.data)
        for start in range(0, total, self.threshold):
            message, chunk = make()
            chunk.chunk_id, chunk.offset, chunk.total = self.chunk_id, start, total
            chunk.data = bytes(self.data[start : start + self.threshold])
            yield message

    def frames(self, field: int) -> list[EncodedChunk]:
        """The same pieces as stream messages (``chunk_wire``'s ``field``) that are
        written straight from the tensor's memory as each is sent."""
        return encoded(field, self.chunk_id, self.data, self.threshold)


def unsent(data: memoryview, threshold: int = CHUNK_BYTES) -> Unsent:
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    return Unsent(uuid.uuid4().hex, data.cast("B"), threshold)


Buffer = bytearray | mmap.mmap


def destination(total: int) -> Buffer:
    if total < _HUGE_BYTES:
        return bytearray(total)
    buffer = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


@dataclass
class _Pending:
    total: int
    buffer: Buffer
    received: int = 0


class Chunk(Protocol):
    """A TensorChunk as parsed by protobuf or read by hand (``chunk_wire.WireChunk``)."""

    @property
    def chunk_id(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def data(self) -> bytes | memoryview: ...


class ChunkAssembler:
    """Collects the chunks of one stream until the tensors referencing them arrive.

    ``max_pending_bytes`` bounds the memory one stream can hold: a chunk whose
    declared total would pass it (or ``budget``, when given) is refused before
    anything is kept. The rest of a refused tensor's chunks are dropped, and the
    message that refers to it gets the same RESOURCE_EXHAUSTED.
    """

    def __init__(self, max_pending_bytes: int, budget: Reservations | None = None) -> None:
        self.max_pending_bytes = max_pending_bytes
        self._budget = budget
        self._pending: dict[str, _Pending] = {}
        self._refused: OrderedDict[str, ResourceExhausted] = OrderedDict()

    @property
    def pending_bytes(self) -> int:
        # Declared totals, not bytes received: the reservation is made at the first chunk.
        return sum(p.total for p in self._pending.values())

    def add(self, chunk: Chunk) -> None:
        data = chunk.data
        if not chunk.chunk_id:
            raise InvalidArgument("chunk.chunk_id: missing", field="chunk")
        pending = self._pending.get(chunk.chunk_id)
        if pending is None and chunk.chunk_id in self._refused:
            return  # the tensor was refused at its first chunk: said once, not per chunk
        if pending is None:
            if chunk.offset != 0:
                raise InvalidArgument(
                    f"chunk: {chunk.chunk_id} starts at offset {chunk.offset}, expected 0 "
                    "(chunks arrive in order)",
                    field="chunk",
                )
            try:
                if self.pending_bytes + chunk.total > self.max_pending_bytes:
                    raise ResourceExhausted(
                        f"chunk: {chunk.chunk_id} needs {chunk.total} bytes; this stream already "
                        f"holds {self.pending_bytes} of at most {self.max_pending_bytes}",
                        field="chunk",
                    )
                if self._budget is not None:
                    self._budget.reserve(chunk.total, "chunk")
            except ResourceExhausted as exc:
                self._refused[chunk.chunk_id] = exc
                while len(self._refused) > _REFUSED_KEPT:
                    self._refused.popitem(last=False)
                raise
            pending = _Pending(chunk.total, destination(chunk.total))
            self._pending[chunk.chunk_id] = pending
        elif chunk.offset != pending.received:
            raise InvalidArgument(
                f"chunk: {chunk.chunk_id} offset {chunk.offset}, expected {pending.received} "
                "(chunks arrive in order, each once)",
                field="chunk",
            )
        if chunk.total != pending.total:
            raise InvalidArgument(
                f"chunk: {chunk.chunk_id} total {chunk.total} after {pending.total}", field="chunk"
            )
        if pending.received + len(data) > pending.total:
            raise InvalidArgument(
                f"chunk: {chunk.chunk_id} runs past its total of {pending.total} bytes",
                field="chunk",
            )
        pending.buffer[pending.received : pending.received + len(data)] = data
        pending.received += len(data)

    def resolve(self, tensors: MutableSequence[tensor_pb2.Tensor], field: str) -> None:
        """Turn every ``chunked`` tensor into raw bytes, in place, and free its chunks.

        All refs are checked before any tensor changes, so an error leaves
        ``tensors`` as it was.
        """
        self._resolve(tensors, "data", "raw", field)

    def resolve_blobs(self, blobs: MutableSequence[tensor_pb2.Blob], field: str) -> None:
        """``resolve`` for blobs: every ``chunked`` blob gets its ``data`` back."""
        self._resolve(blobs, "payload", "data", field)

    def _resolve(
        self,
        messages: Sequence[tensor_pb2.Tensor | tensor_pb2.Blob],
        oneof: str,
        inline: str,
        field: str,
    ) -> None:
        ready: list[tuple[tensor_pb2.Tensor | tensor_pb2.Blob, str]] = []
        for i, message in enumerate(messages):
            if message.WhichOneof(oneof) != "chunked":
                continue
            ref = message.chunked
            if any(chunk_id == ref.chunk_id for _, chunk_id in ready):
                raise InvalidArgument(
                    f"{field}[{i}].chunked: {ref.chunk_id!r} is referenced twice",
                    field=f"{field}[{i}]",
                )
            self._complete(ref, f"{field}[{i}]")
            ready.append((message, ref.chunk_id))
        for message, chunk_id in ready:
            pending = self._pending.pop(chunk_id)
            setattr(message, inline, bytes(pending.buffer))
            if self._budget is not None:
                # From here the bytes are the message's: the caller budgets them as input.
                self._budget.release(pending.total)

    def take(self, ref: tensor_pb2.ChunkRef, field: str) -> Buffer:
        """The assembled bytes of ``ref``, handed over (no copy) and forgotten here;
        from now on they are the caller's to budget, as resolved bytes are."""
        self._complete(ref, field)
        pending = self._pending.pop(ref.chunk_id)
        if self._budget is not None:
            self._budget.release(pending.total)
        return pending.buffer

    def _complete(self, ref: tensor_pb2.ChunkRef, field: str) -> _Pending:
        pending = self._pending.get(ref.chunk_id)
        refused = self._refused.get(ref.chunk_id) if pending is None else None
        if refused is not None:
            raise ResourceExhausted(
                f"{field}.chunked: its chunks were refused ({refused.message})", field=field
            )
        if pending is None or pending.received != pending.total:
            got = "no chunks" if pending is None else f"{pending.received} of {pending.total}"
            raise InvalidArgument(
                f"{field}.chunked: chunks of {ref.chunk_id!r} are incomplete ({got} "
                "bytes); they must arrive before the message that refers to them",
                field=field,
            )
        if ref.nbytes != pending.total:
            raise InvalidArgument(
                f"{field}.chunked: nbytes {ref.nbytes} but its chunks hold {pending.total}",
                field=field,
            )
        return pending

    def discard_all(self) -> None:
        """Drop every unfinished tensor (the stream is gone), giving its budget back."""
        # Detached first: a resolve still running in a decoding thread then finds
        # its entries gone rather than releasing them a second time.
        pending, self._pending = self._pending, {}
        self._refused.clear()
        if self._budget is not None:
            self._budget.release(sum(p.total for p in pending.values()))
