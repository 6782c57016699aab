"""A decode step's whole layer stack in one C call (``_decode_stack.c``).

The lean forward's C glue path (lean_forward.py, fused_ops.py) runs a layer as about
ten calls, each with its Python wrapper and its own OpenMP parallel region. On
SmolLM2-135M that dispatch was about 40 % of a batch-1 decode step. Here one call
runs every layer of a step in which each row brings one token, inside one parallel
region, and computes exactly what the glue path computes (the same C functions, in
the same order): the results are equal bit for bit, which the tests assert.

It applies where the glue path does (the kernels built, Llama-style float32 norms)
and, besides, every projection is on GGUF blocks (q, k, v and gate, up fused), there
are no per-head q/k norms, and the shapes are a plain decoder's. ``DecodeStack.of``
says why not otherwise; the glue path then runs as before.

The C side reads the layers as an array of structs (``StackLayer``), mirrored here
with ctypes and checked against the compiled layout at import.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from services.engines.transformers import fused_ops
from services.engines.transformers.block_linear import MANY_ROWS, BlockLinear, kernels

_KINDS = {"q4_1": 0, "q8_0": 1}  # BLOCK_Q4_1, BLOCK_Q8_0 in _kernels.h


class _BlockWeight(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("qs", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


class _StackLayer(ctypes.Structure):
    _fields_ = [
        ("norm_in", ctypes.c_void_p),
        ("norm_post", ctypes.c_void_p),
        ("eps_in", ctypes.c_float),
        ("eps_post", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("qkv", _BlockWeight),
        ("o", _BlockWeight),
        ("gate_up", _BlockWeight),
        ("down", _BlockWeight),
    ]


class _StackCache(ctypes.Structure):
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("row", ctypes.c_int64),
        ("head", ctypes.c_int64),
    ]


def unavailable() -> str | None:
    """Why the stack cannot run here, or None when it can."""
    reason = fused_ops.unavailable()
    if reason is not None:
        return reason
    assert kernels is not None
    if not hasattr(kernels, "decode_stack"):
        return "the block kernels predate the decode stack (rebuild them)"
    mirrored = {
        "BlockWeight": ctypes.sizeof(_BlockWeight),
        "StackLayer": ctypes.sizeof(_StackLayer),
        "StackLayer.qkv": _StackLayer.qkv.offset,
        "StackLayer.down": _StackLayer.down.offset,
        "StackCache": ctypes.sizeof(_StackCache),
    }
    if kernels.stack_layout() != mirrored:
        return f"the C structs are laid out as {kernels.stack_layout()}, not {mirrored}"
    return None


@dataclass
class StackParts:
    """One layer as the lean forward holds it."""

    norm_in: nn.Module
    norm_post: nn.Module
    qkv: object  # a BlockLinear where q, k and v fused
    o: nn.Module
    gate_up: object
    down: nn.Module
    scale: float
    per_head_norms: bool


def _weight(module: object, n: int, k: int, what: str) -> _BlockWeight:
    if type(module) is not BlockLinear:
        raise _Declined(f"{what} is not one product on GGUF blocks")
    assert isinstance(module, BlockLinear)
    if (module.out_features, module.in_features) != (n, k):
        raise _Declined(f"{what} is {module.out_features} x {module.in_features}, not {n} x {k}")
    bias = module.bias
    if bias is not None and (
        bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()
    ):
        raise _Declined(f"{what}'s bias is not float32 [{n}]")
    return _BlockWeight(
        _KINDS[module.kind],
        module.qs.data_ptr(),
        module.d.data_ptr(),
        None if module.m is None else module.m.data_ptr(),
        n,
        k,
        None if bias is None else bias.data_ptr(),
    )


class _Declined(Exception):
    pass


class DecodeStack:
    """The layers of one model as the C stack reads them (built once; the model's
    modules keep the weights alive, this keeps the modules)."""

    def __init__(
        self,
        parts: Sequence[StackParts],
        norm: nn.Module,
        heads: int,
        kv_heads: int,
        dim: int,
        size: int,
        inter: int,
    ) -> None:
        self.heads, self.kv_heads, self.dim, self.size = heads, kv_heads, dim, size
        self._parts, self._norm = list(parts), norm
        self._layers = (_StackLayer * len(parts))()
        width = (heads + 2 * kv_heads) * dim
        for entry, part in zip(self._layers, parts, strict=True):
            entry.norm_in = _norm_weight(part.norm_in, size)
            entry.norm_post = _norm_weight(part.norm_post, size)
            entry.eps_in = part.norm_in.variance_epsilon
            entry.eps_post = part.norm_post.variance_epsilon
            entry.scale = part.scale
            entry.qkv = _weight(part.qkv, width, size, "q, k and v")
            entry.o = _weight(part.o, size, heads * dim, "o_proj")
            entry.gate_up = _weight(part.gate_up, 2 * inter, size, "gate and up")
            entry.down = _weight(part.down, size, inter, "down_proj")
        self._norm_weight = _norm_weight(norm, size)

    @classmethod
    def of(
        cls,
        parts: Sequence[StackParts],
        norm: nn.Module,
        heads: int,
        kv_heads: int,
        dim: int,
        size: int,
        inter: int,
    ) -> tuple[DecodeStack | None, str | None]:
        """The stack for these layers, or None and why it does not apply."""
        reason = unavailable()
        if reason is None and not parts:
            reason = "the model has no layers"
        if reason is None and any(p.per_head_norms for p in parts):
            reason = "its attention normalises q and k per head"
        if reason is None and (kv_heads < 1 or heads % kv_heads or dim % 2):
            reason = f"{heads} heads over {kv_heads} kv heads of {dim} is not a plain layout"
        if reason is None:
            try:
                return cls(parts, norm, heads, kv_heads, dim, size, inter), None
            except _Declined as declined:
                reason = str(declined)
        return None, reason

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None,
        column: int,
    ) -> torch.Tensor:
        """One decode step: ``h`` [rows, size], the rows' new tokens embedded, is the
        residual stream (added into in place); each layer's keys and values go to
        column ``column`` of its buffers ``caches`` [rows, kv heads, room, dim], and
        attention reads columns 0..column (those set in ``mask`` [rows, column + 1],
        uint8; None: all). ``cos``, ``sin`` [rows, dim]. Returns the final norm's
        output [rows, size]."""
        assert kernels is not None
        rows = h.shape[0]
        if not 0 < rows < MANY_ROWS:
            raise ValueError(f"a decode stack takes 1 to {MANY_ROWS - 1} rows, not {rows}")
        _check("h", h, (rows, self.size), torch.float32)
        _check("cos", cos, (rows, self.dim), torch.float32)
        _check("sin", sin, (rows, self.dim), torch.float32)
        if mask is not None:
            _check("mask", mask, (rows, column + 1), torch.uint8)
        if len(caches) != len(self._layers):
            raise ValueError(f"{len(caches)} caches for {len(self._layers)} layers")
        table = (_StackCache * len(caches))()
        for entry, (keys, values) in zip(table, caches, strict=True):
            if keys.shape != values.shape or keys.stride() != values.stride():
                raise ValueError("keys and values must be buffers of one layout")
            _check("keys", keys, (rows, self.kv_heads, keys.shape[2], self.dim), torch.float32)
            _check("values", values, (rows, self.kv_heads, keys.shape[2], self.dim), torch.float32)
            if keys.shape[2] <= column:
                raise ValueError(f"a cache of {keys.shape[2]} columns has no column {column}")
            entry.keys, entry.values = keys.data_ptr(), values.data_ptr()
            entry.row, entry.head = keys.stride(0), keys.stride(1)
        states = torch.empty_like(h)
        kernels.decode_stack(
            ctypes.addressof(self._layers), ctypes.addressof(table), len(table), h.data_ptr(),
            rows, self.heads, self.kv_heads, self.dim, cos.data_ptr(), sin.data_ptr(),
            0 if mask is None else mask.data_ptr(), column, self._norm_weight,
            self._norm.variance_epsilon, states.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return states


def _norm_weight(norm: nn.Module, size: int) -> int:
    if not fused_ops.plain_rms_norm(norm):
        raise _Declined(f"{type(norm).__name__} is not Llama's float32 RMSNorm")
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    if weight.shape != (size,):
        raise _Declined(f"a norm's weight is {list(weight.shape)}, not [{size}]")
    return weight.data_ptr()


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tensor.dtype != dtype or not tensor.is_contiguous() or tuple(tensor.shape) != shape:
        raise ValueError(
            f"{name} must be contiguous {dtype} {list(shape)}, "
            f"not {tensor.dtype} {list(tensor.shape)} with strides {tensor.stride()}"
        )
