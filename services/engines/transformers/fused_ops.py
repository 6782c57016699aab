"""The float32 glue of a decoder layer in one C call each (``_decode_glue.c``).

With its products on GGUF blocks, a SmolLM2 decode token spent about as long in the
~35 small torch ops between them (RMSNorm's five, rotary's ten, the split copies,
SiLU, the residual adds, SDPA for one query) as in the products: each is a few
microseconds of dispatch for a few hundred floats of work. These do the same
arithmetic in one pass each, with the rounding torch's float32 path has up to the
order of a sum (rotary: bit for bit). They run only where the block kernels were
built (``unavailable``), on float32 tensors; the lean forward keeps torch's ops
otherwise, and for norms that are not Llama's (``plain_rms_norm``).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engines.transformers.block_linear import kernels

# The model families whose RMSNorm is Llama's: float32 weight * (x * rsqrt(mean(x^2) +
# variance_epsilon)). Gemma's scales by (1 + weight) and is left to torch.
_PLAIN_RMS_NORMS = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm"}
)


def unavailable() -> str | None:
    """Why the fused ops cannot run here, or None when they can."""
    if kernels is None:
        return "the block kernels were not built"
    if not hasattr(kernels, "add_rms_norm"):
        return "the block kernels predate the fused ops (rebuild them)"
    return None


def plain_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is Llama's RMSNorm over a float32 weight (by class and the
    attributes its forward reads)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ in _PLAIN_RMS_NORMS
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.dim() == 1
        and weight.is_contiguous()
    )


def _threads() -> int:
    return torch.get_num_threads()


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Every call checks (a wrong pointer is memory corruption, not an exception), as
    cheaply as it can: this runs a few times a layer."""
    if tensor.dtype is not torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous float32, not {tensor.dtype} {tensor.stride()}")
    if tensor.shape != shape:
        raise ValueError(f"{name} must be {list(shape)}, not {list(tensor.shape)}")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module) -> torch.Tensor:
    """``h += delta`` in place (the residual add; skipped when None), then ``norm(h)``
    as a new tensor; ``norm`` must be ``plain_rms_norm``. h, delta: [rows, hidden]."""
    assert kernels is not None
    rows, size = h.shape
    _check("h", h, (rows, size))
    if delta is not None:
        _check("delta", delta, (rows, size))
    weight, eps = norm.weight, norm.variance_epsilon
    assert isinstance(weight, torch.Tensor) and isinstance(eps, float), "a plain_rms_norm"
    _check("norm weight", weight, (size,))
    out = torch.empty_like(h)
    kernels.add_rms_norm(
        h.data_ptr(), 0 if delta is None else delta.data_ptr(), rows, size, weight.data_ptr(),
        eps, out.data_ptr(), _threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused gate/up product [rows, 2 * inter] = [gate | up]."""
    assert kernels is not None
    rows, both = gate_up.shape
    _check("gate_up", gate_up, (rows, both))
    if both % 2:
        raise ValueError(f"gate_up's width must be even, not {both}")
    out = gate_up.new_empty(rows, both // 2)
    kernels.silu_mul(gate_up.data_ptr(), rows, both // 2, out.data_ptr(), _threads())
    return out


def rotary_(qkv: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embeddings in place on the first ``heads`` heads (q's, then k's) of each
    row of ``qkv`` [rows, width], with ``cos``, ``sin`` [rows, dim] (rotate_half's
    convention): transformers' apply_rotary_pos_emb, bit for bit."""
    assert kernels is not None
    rows, width = qkv.shape
    _check("qkv", qkv, (rows, width))
    _check("cos", cos, (rows, dim))
    _check("sin", sin, (rows, dim))
    kernels.rotary(
        qkv.data_ptr(), rows, width, heads, dim, cos.data_ptr(), sin.data_ptr(), _threads()
    )


def attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor | None:
    """softmax(q k^T * scale) v for q [rows, heads, 1, D] against keys and values [rows,
    kv heads, K, D] read in place, grouped-query, over the keys ``mask`` [rows, 1, 1, K]
    (bool, as kv_rows.attention_mask builds it; None: all) lets each row see:
    [rows, 1, heads * D]. None where the layout is not one the kernel reads (each
    head's D floats and each key's in a row; keys and values alike), so the caller
    keeps torch's SDPA."""
    assert kernels is not None
    rows, heads, one, dim = q.shape
    key_rows, kv_heads, columns, key_dim = keys.shape
    q_strides, key_strides = q.stride(), keys.stride()
    float32 = torch.float32
    if (
        one != 1
        or key_rows != rows
        or key_dim != dim
        or columns == 0
        or heads % kv_heads
        or q.dtype is not float32
        or keys.dtype is not float32
        or values.dtype is not float32
        or q_strides[3] != 1
        or key_strides[3] != 1
        or key_strides[2] != dim
        or keys.shape != values.shape
        or key_strides != values.stride()
    ):
        return None
    seen = None
    if mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != (rows, 1, 1, columns):
            return None
        seen = mask.reshape(rows, columns).contiguous().view(torch.uint8)
    out = q.new_empty(rows, 1, heads * dim)
    kernels.attend_one(
        q.data_ptr(), q_strides[0], q_strides[1], keys.data_ptr(), values.data_ptr(),
        key_strides[0], key_strides[1], 0 if seen is None else seen.data_ptr(), columns,
        rows, heads, kv_heads, columns, dim, scale, out.data_ptr(), _threads(),
    )  # fmt: skip
    return out
