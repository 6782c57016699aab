"""Tensor <-> omni.v1.Tensor, inline bytes only (shared-memory and CUDA IPC refs
are resolved by the data plane before a tensor gets here).

Bytes are the tensor's row-major (C order) memory: no pickle, no numpy format
headers, so any language can read them from dtype + shape.
"""

from __future__ import annotations

import torch

from services.mesh.data.chunks import Buffer
from services.mesh.data.wire import MAX_RANK, concat_raw, nbytes_of
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
__all__ = ["DTYPES", "MAX_RANK", "concat_raw", "from_buffer", "from_proto", "nbytes_of", "to_proto"]


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


def from_buffer(msg: tensor_pb2.Tensor, buffer: Buffer, field: str = "tensor") -> torch.Tensor:
    """A chunked tensor's assembled bytes as the tensor itself, without a copy: the
    tensor owns ``buffer`` (writable, and nobody else's) from now on."""
    expected = nbytes_of(msg, field)
    if len(buffer) != expected:
        raise InvalidArgument(
            f"{field}.chunked: dtype {msg.dtype} and shape {list(msg.shape)} need {expected} "
            f"bytes, the chunks hold {len(buffer)}",
            field=f"{field}.chunked",
        )
    dtype = DTYPES[msg.dtype]
    if expected == 0:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(msg.shape))


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
