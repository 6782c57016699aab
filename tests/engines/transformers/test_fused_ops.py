"""The decode-step glue in C (fused_ops.py) computes what torch's float32 ops compute.

Each op runs on SmolLM2's widths against a float64 reference of the same formula; its
error may be no more than a small multiple of torch's own float32 path's error on the
same inputs (tests/helpers/float_error.py). Rotary does the same products and sums as
transformers' apply_rotary_pos_emb, so it must be bit for bit. Row counts cover one
decode row and enough rows to cross the threads' threshold.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from services.engines.transformers import fused_ops
from services.engines.transformers.lean_forward import lean_of
from tests.engines.transformers.test_lean_forward import (
    CONFIGS,
    STEPS,
    exact_run,
    through_kv_rows,
    tiny,
    transformers_copy,
)
from tests.helpers.float_error import assert_float32_close, assert_same_choices

pytestmark = pytest.mark.skipif(
    fused_ops.unavailable() is not None,
    reason=f"fused ops not built: {fused_ops.unavailable()} (setup.py build_ext --inplace)",
)

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
def test_add_rms_norm_adds_in_place_and_normalises_as_torch(rows: int, size: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    norm = _norm(generator, size)
    h = torch.randn(rows, size, generator=generator) * 3
    delta = torch.randn(rows, size, generator=generator)
    summed = h + delta
    mine_h = h.clone()
    mine = fused_ops.add_rms_norm(mine_h, delta, norm)
    assert torch.equal(mine_h, summed)  # the residual add, rounded once as torch's
    exact_h = summed.double()
    weight = norm.weight.double()
    exact = weight * exact_h * torch.rsqrt(exact_h.square().mean(-1, keepdim=True) + 1e-5)
    assert_float32_close(mine, norm(summed), exact)
    alone = fused_ops.add_rms_norm(summed.clone(), None, norm)  # no add
    assert_float32_close(alone, norm(summed), exact)


@pytest.mark.parametrize("inter", [INTER, 77])  # 77: a vector and a partial one
@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_silu_mul_is_silu_of_gate_times_up(rows: int, inter: int) -> None:
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's range ends
    gate, up = gate_up.chunk(2, dim=-1)
    exact = functional.silu(gate.double()) * up.double()
    assert_float32_close(fused_ops.silu_mul(gate_up), functional.silu(gate) * up, exact)


@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_rotary_in_place_is_transformers_rotary_bit_for_bit(rows: int) -> None:
    """On the fused qkv product: q's and k's heads rotated, v's untouched."""
    generator = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=generator)
    angles = torch.rand(rows, DIM // 2, generator=generator) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    before = qkv.clone()
    heads = qkv.view(rows, -1, DIM)  # a view: sees the rotation in place
    q, k = apply_rotary_pos_emb(heads[:, :HEADS], heads[:, HEADS : HEADS + KV_HEADS], cos, sin)
    v = heads[:, HEADS + KV_HEADS :].clone()
    fused_ops.rotary_(qkv, HEADS + KV_HEADS, DIM, cos, sin)
    assert torch.equal(heads[:, :HEADS], q)
    assert torch.equal(heads[:, HEADS : HEADS + KV_HEADS], k)
    assert torch.equal(heads[:, HEADS + KV_HEADS :], v)
    assert not torch.equal(qkv, before)  # not vacuous: it rotated


def _cache(rows: int, columns: int, generator: torch.Generator, dim: int = DIM) -> torch.Tensor:
    """Keys or values [rows, kv heads, columns, D] as KvRows holds them: the leading
    columns of a buffer with room to grow."""
    buffer = torch.randn(rows, KV_HEADS, columns + 16, dim, generator=generator)
    return buffer[:, :, :columns]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    ("rows", "columns", "dim"),
    [(1, 1, DIM), (1, 37, DIM), (8, 300, DIM), (3, 1000, DIM), (2, 40, 24)],
)  # dim 24: not a multiple of 16, so the portable loop even where AVX-512 is
@torch.inference_mode()
def test_attend_one_is_grouped_query_sdpa(rows: int, columns: int, dim: int, masked: bool) -> None:
    """q read in place from the fused qkv product; keys and values from the cache's
    buffers; each query head against its group's kv head; with a mask as a padded
    decode batch has (kv_rows.attention_mask: each row sees its newest column)."""
    generator = torch.Generator().manual_seed(columns)
    qkv = torch.randn(rows, 1, (HEADS + 2 * KV_HEADS) * dim, generator=generator) * 2
    q = qkv.view(rows, 1, -1, dim).transpose(1, 2)[:, :HEADS]
    keys, values = _cache(rows, columns, generator, dim), _cache(rows, columns, generator, dim)
    mask = None
    if masked:
        mask = torch.rand(rows, 1, 1, columns, generator=generator) < 0.6
        mask[..., -1] = True
    scale = dim**-0.5
    mine = fused_ops.attend_one(q, keys, values, mask, scale)
    assert mine is not None
    trusted = functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    exact = functional.scaled_dot_product_attention(
        q.double(), keys.double(), values.double(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    assert_float32_close(
        mine, trusted.reshape(rows, 1, -1), exact.reshape(rows, 1, -1)
    )  # [rows, 1, heads * D], as the lean forward's attend returns


@torch.inference_mode()
def test_attend_one_declines_layouts_it_does_not_read() -> None:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, 1, DIM, generator=generator)
    keys, values = _cache(2, 5, generator), _cache(2, 5, generator)
    assert fused_ops.attend_one(q, keys, values, None, 0.125) is not None
    assert fused_ops.attend_one(q.double(), keys.double(), values.double(), None, 0.125) is None
    assert fused_ops.attend_one(q, keys.transpose(2, 3).contiguous().transpose(2, 3),
                                values, None, 0.125) is None  # fmt: skip
    assert fused_ops.attend_one(torch.randn(2, HEADS, 2, DIM), keys, values, None, 0.125) is None
    assert fused_ops.attend_one(q, keys[:, :, :0], values[:, :, :0], None, 0.125) is None
    causal = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    assert fused_ops.attend_one(q, keys, values, causal, 0.125) is not None
    assert fused_ops.attend_one(q, keys, values, causal.float(), 0.125) is None  # additive
    assert fused_ops.attend_one(q, keys, values, causal[..., :4], 0.125) is None


def test_bad_tensors_are_refused_naming_the_argument() -> None:
    norm = LlamaRMSNorm(HIDDEN)
    with pytest.raises(ValueError, match="delta must be"):
        fused_ops.add_rms_norm(torch.zeros(2, HIDDEN), torch.zeros(3, HIDDEN), norm)
    with pytest.raises(ValueError, match="h must be contiguous float32"):
        fused_ops.add_rms_norm(torch.zeros(2, HIDDEN, dtype=torch.float64), None, norm)
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        fused_ops.silu_mul(torch.zeros(4, 2 * INTER).t())
    with pytest.raises(ValueError, match="cos must be"):
        fused_ops.rotary_(torch.zeros(2, 15 * DIM), 12, DIM, torch.zeros(2, 32), torch.zeros(2, 64))


def test_only_llamas_float32_rms_norm_is_taken() -> None:
    assert fused_ops.plain_rms_norm(LlamaRMSNorm(HIDDEN))
    assert not fused_ops.plain_rms_norm(GemmaRMSNorm(HIDDEN))  # scales by 1 + weight
    assert not fused_ops.plain_rms_norm(LlamaRMSNorm(HIDDEN).to(torch.bfloat16))


# -- in the lean forward ---------------------------------------------------------------

SAME_LENGTH = [[5, 17, 99, 3, 64], [41, 8, 120, 33, 2], [77, 1, 9, 30, 6]]  # no padding


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_lean_forward_on_the_c_glue_matches_transformers(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of one length, so every decode step has no mask and attends in C: the
    lean forward's logits and states on the C glue against transformers' forward,
    both against float64, and the same greedy tokens."""
    model = tiny(name)
    plain, _ = transformers_copy(model)
    lean = lean_of(model)
    assert lean is not None and lean.fused
    attended: list[int] = []
    real = fused_ops.attend_one

    def counted(*args: object) -> torch.Tensor | None:
        out = real(*args)  # type: ignore[arg-type]
        attended.append(out is not None)
        return out

    monkeypatch.setattr(fused_ops, "attend_one", counted)
    trusted = through_kv_rows(plain, SAME_LENGTH)
    mine = through_kv_rows(model, SAME_LENGTH, trusted.tokens)
    layers = model.config.num_hidden_layers
    assert attended == [True] * (STEPS * layers)  # each decode step, each layer, in C
    reference = exact_run(model, SAME_LENGTH, trusted.tokens)
    (mine_logits, mine_states), (plain_logits, plain_states) = mine.stacked(), trusted.stacked()
    assert_float32_close(mine_logits, plain_logits, reference.logits[0])
    assert_float32_close(mine_states, plain_states, reference.states[0])
    assert_same_choices(mine_logits, plain_logits, reference.logits[0])
    assert torch.equal(mine.tokens, trusted.tokens)
