"""The tensor wire format without torch: dtype names and sizes, the byte size a
tensor message implies, and joining inline pieces. The orchestrator routes
tensors with these alone, so its process never imports torch.

Bytes are the tensor's row-major (C order) memory in the producer's byte order
(little-endian on every platform we run on); dtype is torch's name without the
``torch.`` prefix.
"""

from __future__ import annotations

import math

from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2

ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
MAX_RANK = 16
MAX_NBYTES = 1 << 62  # no real tensor comes near; larger shapes are hostile or broken
MAX_DIM = (1 << 63) - 1  # a dim is an int64 on the wire


def nbytes_of(msg: tensor_pb2.Tensor, field: str) -> int:
    """The byte size dtype and shape imply, after validating both."""
    itemsize = ITEMSIZE.get(msg.dtype)
    if itemsize is None:
        known = ", ".join(ITEMSIZE)
        raise InvalidArgument(
            f"{field}.dtype: unknown dtype {msg.dtype!r} (expected one of {known})",
            field=f"{field}.dtype",
        )
    if len(msg.shape) > MAX_RANK or any(d < 0 for d in msg.shape):
        raise InvalidArgument(
            f"{field}.shape: expected at most {MAX_RANK} non-negative dims, got {list(msg.shape)}",
            field=f"{field}.shape",
        )
    nbytes = math.prod(msg.shape) * itemsize
    if nbytes > MAX_NBYTES:
        raise InvalidArgument(
            f"{field}.shape: {list(msg.shape)} of {msg.dtype} is {nbytes} bytes, "
            f"beyond any tensor ({MAX_NBYTES})",
            field=f"{field}.shape",
        )
    return nbytes


def concat_raw(pieces: list[tensor_pb2.Tensor], field: str) -> tensor_pb2.Tensor:
    """Join inline tensors of one name along their first dim, bytes only (no decode)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    for piece in pieces:
        nbytes_of(piece, field)
        if (
            piece.dtype != first.dtype
            or list(piece.shape[1:]) != list(first.shape[1:])
            or not (piece.shape)
        ):
            raise InvalidArgument(
                f"{field}: pieces disagree ({piece.dtype} {list(piece.shape)} after "
                f"{first.dtype} {list(first.shape)}); they join along the first dim",
                field=field,
            )
        if piece.WhichOneof("data") not in ("raw", None):
            raise InvalidArgument(f"{field}: pieces must carry inline bytes", field=field)
    shape = [sum(p.shape[0] for p in pieces), *first.shape[1:]]
    if shape[0] > MAX_DIM or math.prod(shape) * ITEMSIZE[first.dtype] > MAX_NBYTES:
        raise InvalidArgument(
            f"{field}: joined, the pieces would be {shape}, too large for a tensor", field=field
        )
    raw = b"".join(p.raw for p in pieces)
    return tensor_pb2.Tensor(name=first.name, dtype=first.dtype, shape=shape, raw=raw)
