"""A decoder layer's float32 glue, on every kernel variant, computes what torch's float32
ops compute.

Each op runs on SmolLM2's widths (and widths that leave a partial vector) against a
float64 reference of the same formula; its error may be no more than a small
multiple of torch's own float32 path's error on the same inputs (tests/helpers/
float_error.py). Rotary does the same products and sums as transformers'
apply_rotary_pos_emb, so it must be bit for bit. Row counts cover one decode row and
enough rows to cross the threads' threshold.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from services import kernels
from tests.helpers.float_error import assert_float32_close

HIDDEN, INTER, HEADS, KV_HEADS, DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M
ROWS = (1, 8, 64)  # 64: past the threshold from which the threads split rows


def _norm(generator: torch.Generator, size: int) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(size, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(size, generator=generator))
    return norm


@pytest.mark.parametrize("size", [HIDDEN, 100])  # 100: not a multiple of the 16 lanes
@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_rms_norm_adds_in_place_and_normalises_as_torch(variant: str, rows: int, size: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    norm = _norm(generator, size)
    h = torch.randn(rows, size, generator=generator) * 3
    delta = torch.randn(rows, size, generator=generator)
    summed = h + delta
    mine_h = h.clone()
    mine = kernels.ops().rms_norm(mine_h, delta, norm.weight, 1e-5)
    assert torch.equal(mine_h, summed)  # the residual add, rounded once as torch's
    exact_h = summed.double()
    weight = norm.weight.double()
    exact = weight * exact_h * torch.rsqrt(exact_h.square().mean(-1, keepdim=True) + 1e-5)
    assert_float32_close(mine, norm(summed), exact)
    alone = kernels.ops().rms_norm(summed.clone(), None, norm.weight, 1e-5)  # no add
    assert_float32_close(alone, norm(summed), exact)


@pytest.mark.parametrize("inter", [INTER, 77])  # 77: vectors and a partial one
@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_silu_mul_is_silu_of_gate_times_up(variant: str, rows: int, inter: int) -> None:
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's range ends
    gate, up = gate_up.chunk(2, dim=-1)
    exact = functional.silu(gate.double()) * up.double()
    assert_float32_close(kernels.ops().silu_mul(gate_up), functional.silu(gate) * up, exact)


@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_rotary_in_place_is_transformers_rotary_bit_for_bit(variant: str, rows: int) -> None:
    """On a fused qkv product: q's and k's heads rotated, v's untouched."""
    generator = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=generator)
    angles = torch.rand(rows, DIM // 2, generator=generator) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    before = qkv.clone()
    heads = qkv.view(rows, -1, DIM)  # a view: sees the rotation in place
    q, k = apply_rotary_pos_emb(heads[:, :HEADS], heads[:, HEADS : HEADS + KV_HEADS], cos, sin)
    v = heads[:, HEADS + KV_HEADS :].clone()
    kernels.ops().rotary_(qkv, HEADS + KV_HEADS, DIM, cos, sin)
    assert torch.equal(heads[:, :HEADS], q)
    assert torch.equal(heads[:, HEADS : HEADS + KV_HEADS], k)
    assert torch.equal(heads[:, HEADS + KV_HEADS :], v)
    assert not torch.equal(qkv, before)  # not vacuous: it rotated


def _cache(rows: int, columns: int, generator: torch.Generator, dim: int) -> torch.Tensor:
    """Keys or values [rows, kv heads, columns, D] as a cache holds them: the leading
    columns of a buffer with room to grow."""
    buffer = torch.randn(rows, KV_HEADS, columns + 16, dim, generator=generator)
    return buffer[:, :, :columns]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    ("rows", "columns", "dim"),
    [(1, 1, DIM), (1, 37, DIM), (8, 300, DIM), (3, 1000, DIM), (2, 40, 24), (2, 19, 128)],
)  # dim 24: not a multiple of 16 (the reference loop on AVX-512, vectors on AVX2)
@torch.inference_mode()
def test_attend_one_is_grouped_query_sdpa(
    variant: str, rows: int, columns: int, dim: int, masked: bool
) -> None:
    """q read in place from a fused qkv product; keys and values from a cache's
    buffers; each query head against its group's kv head; with a mask as a padded
    decode batch has (each row sees its newest column)."""
    generator = torch.Generator().manual_seed(columns)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * dim, generator=generator) * 2
    q = qkv.view(rows, -1, dim)[:, :HEADS]
    keys, values = _cache(rows, columns, generator, dim), _cache(rows, columns, generator, dim)
    mask = None
    if masked:
        mask = torch.rand(rows, columns, generator=generator) < 0.6
        mask[:, -1] = True
    scale = dim**-0.5
    mine = kernels.ops().attend_one(
        q, keys, values, None if mask is None else mask.to(torch.uint8), scale
    )
    sdpa_mask = None if mask is None else mask[:, None, None]
    q4 = q[:, :, None]
    trusted = functional.scaled_dot_product_attention(
        q4, keys, values, attn_mask=sdpa_mask, scale=scale, enable_gqa=True
    )
    exact = functional.scaled_dot_product_attention(
        q4.double(), keys.double(), values.double(), attn_mask=sdpa_mask, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    assert_float32_close(mine, trusted.reshape(rows, -1), exact.reshape(rows, -1))


def test_bad_tensors_are_refused_naming_the_argument() -> None:
    ops, weight = kernels.ops(), torch.ones(HIDDEN)
    with pytest.raises(RuntimeError, match=r"delta must be \[2, 576\]"):
        ops.rms_norm(torch.zeros(2, HIDDEN), torch.zeros(3, HIDDEN), weight, 1e-5)
    with pytest.raises(RuntimeError, match="h must be Float, not Double"):
        ops.rms_norm(torch.zeros(2, HIDDEN, dtype=torch.float64), None, weight, 1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be contiguous"):
        ops.silu_mul(torch.zeros(4, 2 * INTER).t())
    with pytest.raises(RuntimeError, match=r"cos must be \[2, 64\]"):
        ops.rotary_(torch.zeros(2, 15 * DIM), 12, DIM, torch.zeros(2, 32), torch.zeros(2, 64))
    with pytest.raises(RuntimeError, match="13 heads of 64 do not fit"):
        ops.rotary_(torch.zeros(2, 12 * DIM), 13, DIM, torch.zeros(2, 64), torch.zeros(2, 64))
    keys = torch.zeros(2, KV_HEADS, 5, DIM)
    with pytest.raises(RuntimeError, match="keys and values must have one shape"):
        ops.attend_one(torch.zeros(2, HEADS, DIM), keys, keys[:, :, :4], None, 0.125)
    with pytest.raises(RuntimeError, match="each head's keys must be contiguous"):
        flipped = keys.transpose(2, 3).contiguous().transpose(2, 3)
        ops.attend_one(torch.zeros(2, HEADS, DIM), flipped, flipped, None, 0.125)
    with pytest.raises(RuntimeError, match=r"mask must be \[2, 5\]"):
        ops.attend_one(
            torch.zeros(2, HEADS, DIM), keys, keys, torch.ones(2, 4, dtype=torch.uint8), 0.1
        )
