"""Tensor <-> omni.v1.Tensor, inline bytes only (shared-memory and CUDA IPC refs
are resolved by the data plane before a tensor gets here).

Bytes are the tensor's row-major (C order) memory: no pickle, no numpy format
headers, so any language can read them from dtype + shape.
"""

from __future__ import annotations

import math

import torch

from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2

DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "bool": torch.bool,
        "uint8": torch.uint8,
        "int8": torch.int8,
        "int16": torch.int16,
        "uint16": torch.uint16,
        "int32": torch.int32,
        "uint32": torch.uint32,
        "int64": torch.int64,
        "uint64": torch.uint64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
        "complex64": torch.complex64,
        "complex128": torch.complex128,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
    }.items()
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
MAX_RANK = 16


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return NAMES[dtype]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype} has no wire name") from None


def to_proto(tensor: torch.Tensor, name: str = "") -> tensor_pb2.Tensor:
    """Encode a tensor as inline bytes (one copy: device/strided -> contiguous CPU)."""
    wire = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return tensor_pb2.Tensor(name=name, dtype=wire, shape=list(tensor.shape), raw=raw)


def nbytes_of(msg: tensor_pb2.Tensor, field: str) -> int:
    """The byte size dtype and shape imply, after validating both."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        known = ", ".join(DTYPES)
        raise InvalidArgument(
            f"{field}.dtype: unknown dtype {msg.dtype!r} (expected one of {known})",
            field=f"{field}.dtype",
        )
    if len(msg.shape) > MAX_RANK or any(d < 0 for d in msg.shape):
        raise InvalidArgument(
            f"{field}.shape: expected at most {MAX_RANK} non-negative dims, got {list(msg.shape)}",
            field=f"{field}.shape",
        )
    return math.prod(msg.shape) * dtype.itemsize


def from_proto(msg: tensor_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    """Decode inline bytes, refusing any disagreement between dtype, shape and size."""
    expected = nbytes_of(msg, field)
    kind = msg.WhichOneof("data")
    if kind != "raw" and not (kind is None and expected == 0):
        raise InvalidArgument(
            f"{field}: expected inline bytes here, got {kind or 'no data'}", field=field
        )
    if len(msg.raw) != expected:
        raise InvalidArgument(
            f"{field}.raw: dtype {msg.dtype} and shape {list(msg.shape)} need {expected} bytes, "
            f"got {len(msg.raw)}",
            field=f"{field}.raw",
        )
    dtype = DTYPES[msg.dtype]
    if expected == 0:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    # bytearray gives torch a writable buffer it may own; protobuf's bytes are immutable.
    flat = torch.frombuffer(bytearray(msg.raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(msg.shape))


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
    raw = b"".join(p.raw for p in pieces)
    return tensor_pb2.Tensor(name=first.name, dtype=first.dtype, shape=shape, raw=raw)
