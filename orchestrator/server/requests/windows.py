"""Per-request, per-edge window state: turns an upstream stage's segments into
the windows the downstream stage is sent (docs/design.md, 'Hand-offs').

Items are tokens. Tensors whose first dim equals a segment's token count are
per-token rows (e.g. hidden_states [n, d]) and are split with the tokens by
slicing their raw bytes, never decoding them. A segment's text, its other
tensors and its blobs travel whole with the window that takes its last item. A
segment with no tokens but with tensors or blobs (a rendered image) is one item.

``window=-1`` is the full trigger: nothing until ``finish()``, then one window.
``window=N`` emits N-item windows as soon as they are complete; ``finish()``
emits the rest, always as a window with is_last, so downstream sees an end.
``first_window=M`` makes the first window M items (then N each): the consumer's
first output waits for the producer's prefill and M items, not N.
Tensors of one name within a window are joined along their first dim.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.mesh.data import wire as codec
from services.mesh.data.ref_reader import REFS
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2

FULL = -1


@dataclass(frozen=True)
class Window:
    sequence: int
    is_last: bool
    token_ids: tuple[int, ...]
    text: str
    tensors: tuple[tensor_pb2.Tensor, ...]
    blobs: tuple[tensor_pb2.Blob, ...]


@dataclass
class _Chunk:
    """What is left of one segment; ``taken`` items of it have gone out already."""

    items: int
    token_ids: tuple[int, ...]
    rows: list[tuple[tensor_pb2.Tensor, int]]  # (tensor, bytes per row)
    whole: list[tensor_pb2.Tensor]
    blobs: list[tensor_pb2.Blob]
    text: str
    taken: int = 0

    @property
    def left(self) -> int:
        return self.items - self.taken


@dataclass
class _Builder:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tensors: list[tensor_pb2.Tensor] = field(default_factory=list)
    blobs: list[tensor_pb2.Blob] = field(default_factory=list)

    def build(self, sequence: int, is_last: bool) -> Window:
        by_name: dict[str, list[tensor_pb2.Tensor]] = {}
        for tensor in self.tensors:
            by_name.setdefault(tensor.name, []).append(tensor)
        joined: list[tensor_pb2.Tensor] = []
        for name, pieces in by_name.items():
            if all(p.WhichOneof("data") in ("raw", None) for p in pieces):
                joined.append(codec.concat_raw(pieces, f"window.tensors.{name}"))
            else:
                # Shared blocks cannot be joined without a copy: the pieces travel
                # in order under one name and the consuming stage joins them.
                joined.extend(pieces)
        return Window(
            sequence=sequence,
            is_last=is_last,
            token_ids=tuple(self.token_ids),
            text="".join(self.text),
            tensors=tuple(joined),
            blobs=tuple(self.blobs),
        )


def _chunk(segment: stage_pb2.Segment) -> _Chunk:
    tokens = tuple(segment.token_ids)
    n = len(tokens)
    rows: list[tuple[tensor_pb2.Tensor, int]] = []
    whole: list[tensor_pb2.Tensor] = []
    for tensor in segment.tensors:
        if n and len(tensor.shape) and tensor.shape[0] == n:
            rows.append((tensor, _row_bytes(tensor, n)))
        else:
            whole.append(tensor)
    items = n or (1 if whole or segment.blobs else 0)
    return _Chunk(items, tokens, rows, whole, list(segment.blobs), segment.text_delta)


def _row_bytes(tensor: tensor_pb2.Tensor, rows: int) -> int:
    where = f"segment.tensors.{tensor.name}"
    nbytes = codec.nbytes_of(tensor, where)
    kind = tensor.WhichOneof("data")
    if kind in REFS:
        ref = getattr(tensor, kind)
        if ref.nbytes != nbytes:
            raise InvalidArgument(
                f"{where}: the {kind} ref holds {ref.nbytes} bytes, dtype and shape need {nbytes}",
                field=where,
            )
        return nbytes // rows
    if kind not in ("raw", None) or len(tensor.raw) != nbytes:
        raise InvalidArgument(
            f"{where}: expected {nbytes} inline bytes to split into {rows} rows, "
            f"got {len(tensor.raw)} ({tensor.WhichOneof('data') or 'no data'})",
            field=where,
        )
    return nbytes // rows


def _rows(tensor: tensor_pb2.Tensor, row_bytes: int, start: int, count: int) -> tensor_pb2.Tensor:
    shape = [count, *tensor.shape[1:]]
    kind = tensor.WhichOneof("data")
    if kind in REFS:
        # A ref's rows are a narrower view of the same block: no bytes move.
        piece = tensor_pb2.Tensor()
        piece.CopyFrom(tensor)
        del piece.shape[:]
        piece.shape.extend(shape)
        if kind in ("shm", "pull"):
            ref = piece.shm if kind == "shm" else piece.pull
            ref.offset += start * row_bytes
            ref.nbytes = count * row_bytes
        else:  # the storage offset identifies the allocation; views move view_offset
            piece.cuda_ipc.view_offset += start * row_bytes
            piece.cuda_ipc.nbytes = count * row_bytes
        return piece
    raw = tensor.raw[start * row_bytes : (start + count) * row_bytes]
    return tensor_pb2.Tensor(name=tensor.name, dtype=tensor.dtype, shape=shape, raw=raw)


class WindowState:
    def __init__(self, window: int, first_window: int | None = None) -> None:
        if window != FULL and window < 1:
            raise ValueError(f"window: expected -1 or at least 1, got {window}")
        if first_window is not None and (window == FULL or first_window < 1):
            raise ValueError(
                f"first_window: expected at least 1 with a window N, got {first_window}"
            )
        self._window = window
        self._first = first_window
        self._pending: deque[_Chunk] = deque()
        self._buffered = 0
        self._emitted = 0
        self._finished = False

    @property
    def buffered(self) -> int:
        """Items held now (what the edge's watermarks compare against)."""
        return self._buffered

    @property
    def windows_emitted(self) -> int:
        return self._emitted

    def add(self, segment: stage_pb2.Segment) -> list[Window]:
        """The windows this segment completes, in order (none for the full trigger)."""
        if self._finished:
            raise RuntimeError("add() after finish(): the upstream already ended")
        chunk = _chunk(segment)
        self._pending.append(chunk)
        self._buffered += chunk.items
        out: list[Window] = []
        while self._window != FULL and self._buffered >= (size := self._next_size()):
            out.append(self._take(size, is_last=False))
        return out

    def _next_size(self) -> int:
        return self._first if self._first is not None and not self._emitted else self._window

    def finish(self) -> list[Window]:
        """At upstream end: the rest as one last window (empty if nothing is left)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return [self._take(self._buffered, is_last=True)]

    def _take(self, count: int, *, is_last: bool) -> Window:
        builder = _Builder()
        need = count
        # Item-less chunks (text only, or nothing) ride along with the window
        # being built, so their text is not held back behind the next item.
        while self._pending and (need or not self._pending[0].left):
            chunk = self._pending[0]
            take = min(need, chunk.left)
            self._take_from(chunk, take, builder)
            need -= take
            if not chunk.left:
                self._pending.popleft()
                builder.text.append(chunk.text)
                builder.tensors.extend(chunk.whole)
                builder.blobs.extend(chunk.blobs)
        self._buffered -= count
        window = builder.build(self._emitted, is_last)
        self._emitted += 1
        return window

    @staticmethod
    def _take_from(chunk: _Chunk, take: int, builder: _Builder) -> None:
        if not take:
            return
        start = chunk.taken
        builder.token_ids.extend(chunk.token_ids[start : start + take])
        whole_segment = start == 0 and take == len(chunk.token_ids)
        for tensor, row_bytes in chunk.rows:
            # A segment that fits in one window keeps its tensors as they are: no copy.
            piece = tensor if whole_segment else _rows(tensor, row_bytes, start, take)
            builder.tensors.append(piece)
        chunk.taken += take
