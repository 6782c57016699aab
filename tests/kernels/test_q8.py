"""The 8-bit-activation products, on every kernel variant, on the real SmolLM2 file's
tensors (Q4_1 and Q8_0).

The activations are rounded per 32-block as llama.cpp's Q8_1 does, bit for bit as
torch does the same arithmetic (d = max|x| / 127, q = round-half-even(x / d)), in every
variant. A product is then the float32 sum of exact integer block dot products, so
two derived bounds hold for every variant, never a constant fitted to one CPU:

- against float64 of the same rounded activations x^ (d q, exact in float64), within
  Higham's any-order bound k * eps * sum(|w| |x^|): only the float32 additions and
  scalings differ, the integer parts are exact;
- against float64 of the float32 activations x, within sum(|w| (d / 2 + 2 eps |x|))
  more: each x moved by at most half a step d / 2 (plus the rounding of x * (1 / d)).

The reference variant is the oracle of the vector ones: both within the first bound of
the same float64 sum. A block one quantisation step off fails it. Every test runs on
the file's layout and (``layout`` packed) on the weight packed for the 8-bit products,
as a model on 8-bit activations holds its weights.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from services import kernels
from services.engines.transformers.weights.blocks import Blocks
from tests.helpers.float_error import FLOAT32_EPS
from tests.kernels.conftest import FileWeight
from tests.kernels.test_blocks import ROWS, _one_block_off

QK = 32


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_1's rounding in torch: (q, d, s) as the kernels must give them."""
    blocks = x.view(x.shape[0], -1, QK)
    d = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None])
    return q.to(torch.int8).view_as(x), d, d * q.sum(-1)


def _exact(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x^ = d q in float64 (exact)."""
    rows, k = q.shape
    return (q.double().view(rows, -1, QK) * d.double()[..., None]).view(rows, k)


@pytest.fixture(params=["file", "packed"])
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _product(
    blocks: Blocks, x: torch.Tensor, bias: torch.Tensor | None = None, layout: str = "file"
) -> torch.Tensor:
    ops = kernels.ops()
    packed = ops.pack_blocks(blocks.qs, blocks.d, blocks.m) if layout == "packed" else None
    return ops.block_linear(x, blocks.qs, blocks.d, blocks.m, bias, True, packed)


def test_activations_round_as_llama_cpp_q8_1_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1536, generator=g) * torch.rand(7, 1536, generator=g) * 4
    x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, 5] = 1e-30  # tiny beside its neighbours: rounds to 0
    q, d, s = kernels.ops().quantize_q8(x)
    want_q, want_d, want_s = _rounded(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d) and torch.equal(s, want_s)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    moved = (x.double() - _exact(q, d)).abs().view(7, -1, QK)
    step = d.double()[..., None]
    assert bool((moved <= step / 2 + 2 * FLOAT32_EPS * x.double().abs().view(7, -1, QK)).all())


def _bounds(
    file_weight: FileWeight, x: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float64 of w . x^, its any-order float32 bound, float64 of w . x, the bound
    with the activations' rounding added)."""
    q, d, _ = _rounded(x)
    rounded = _exact(q, d)
    exact_bias = None if bias is None else bias.double()
    k = rounded.shape[1]
    on_rounded = functional.linear(rounded, file_weight.exact, exact_bias)
    bound = k * FLOAT32_EPS * functional.linear(rounded.abs(), file_weight.magnitude)
    if exact_bias is not None:
        bound += (k + 1) * FLOAT32_EPS * exact_bias.abs()
    step = d.double().repeat_interleave(QK, dim=1) / 2 + 2 * FLOAT32_EPS * x.double().abs()
    on_x = functional.linear(x.double(), file_weight.exact, exact_bias)
    return on_rounded, bound, on_x, bound + functional.linear(step, file_weight.magnitude)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@torch.inference_mode()
def test_int8_products_are_within_the_rounding_bound(
    variant: str, file_weight: FileWeight, with_bias: bool, layout: str
) -> None:
    n, k = file_weight.blocks.shape
    noise = torch.Generator().manual_seed(0)
    bias = torch.randn(n, generator=noise) if with_bias else None
    for rows in ROWS:
        x = torch.randn(rows, k, generator=noise)
        y = _product(file_weight.blocks, x, bias, layout).double()
        on_rounded, bound, on_x, rounding_bound = _bounds(file_weight, x, bias)
        assert ((y - on_rounded).abs() / bound).max().item() <= 1.0, (variant, rows)
        assert ((y - on_x).abs() / rounding_bound).max().item() <= 1.0, (variant, rows)


@torch.inference_mode()
def test_vector_variants_agree_with_the_reference(
    variant: str, file_weight: FileWeight, layout: str
) -> None:
    """The reference's sum and this variant's: each within the any-order bound of the
    same exact sum, so within twice it of each other, on every row."""
    k = file_weight.blocks.shape[1]
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    mine = _product(file_weight.blocks, x, layout=layout).double()
    with kernels.using("reference"):
        oracle = _product(file_weight.blocks, x).double()
    _, bound, _, _ = _bounds(file_weight, x, None)
    assert ((mine - oracle).abs() / (2 * bound)).max().item() <= 1.0, variant


@torch.inference_mode()
def test_a_row_gets_the_same_int8_sum_in_any_tile(
    variant: str, file_weight: FileWeight, layout: str
) -> None:
    blocks = file_weight.blocks
    x = torch.randn(17, blocks.shape[1], generator=torch.Generator().manual_seed(3))
    alone = torch.cat([_product(blocks, x[r : r + 1], layout=layout) for r in range(17)])
    for rows in (2, 3, 5, 7, 8, 9, 17):
        got = _product(blocks, x[:rows], layout=layout)
        assert torch.equal(got, alone[:rows]), (variant, rows)


@torch.inference_mode()
def test_a_block_one_step_off_fails_the_int8_bound(
    variant: str, file_weight: FileWeight, layout: str
) -> None:
    """One block of one output row, each weight one step off, against activations
    whose signs follow the change (so that the 32 changes add up rather than cancel
    by chance): caught."""
    blocks = file_weight.blocks
    n, k = blocks.shape
    row, block = n // 2, k // 64
    wrong = _one_block_off(blocks, row, block)
    change = wrong.dequantize()[row] - file_weight.weight[row]
    for rows in (1, 9):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        x[:, change != 0] = x[:, change != 0].abs() * change[change != 0].sign()
        on_rounded, bound, _, _ = _bounds(file_weight, x, None)
        y = _product(wrong, x, layout=layout).double()
        worst = ((y - on_rounded).abs() / bound).max().item()
        assert worst > 1.0, (variant, rows, worst)


def test_quantize_refuses_a_width_off_the_blocks() -> None:
    with pytest.raises(RuntimeError, match="x's width must be a multiple of 32, not 40"):
        kernels.ops().quantize_q8(torch.zeros(2, 40))
