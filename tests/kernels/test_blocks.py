"""GGUF block products and dequantisation, on every kernel variant, on the real SmolLM2
file's tensors: a weight dequantises bit for bit as gguf-py does, whatever the
variant; a product is float32's up to the order of its additions.

What "float32's" means is derived, never fitted: against a float64 reference a
product may err as the suite allows any reordered float32 path (tests/helpers/
float_error.py: a multiple of torch's own float32 product's error), and no element
beyond the worst case of any summation order, k * eps * sum(|x| |w|) (Higham's bound
for a dot product of length k). A block one quantisation step off fails both.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from services import kernels
from services.engines.transformers.weights.blocks import Blocks
from tests.helpers.float_error import FLOAT32_EPS, RowErrors, row_errors
from tests.kernels.conftest import FileWeight

# 1 row: itself; 3 and 7: one tile padded to 4 and to 8 with zero rows; 8: a whole
# tile; 9: a tile and one row; 13: a tile and a padded one; 40: five tiles.
ROWS = (1, 3, 7, 8, 9, 13, 40)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 as its bit patterns: equal means bit for bit (-0.0 is not 0.0)."""
    return t.contiguous().view(torch.int32)


def _product(blocks: Blocks, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return kernels.ops().block_linear(x, blocks.qs, blocks.d, blocks.m, bias)


def test_blocks_dequantise_bit_for_bit_as_gguf_py(variant: str, file_weight: FileWeight) -> None:
    blocks = file_weight.blocks
    out = torch.empty(blocks.shape)
    kernels.ops().block_dequantize(blocks.qs, blocks.d, blocks.m, out)
    assert torch.equal(_bits(out), _bits(file_weight.weight)), variant


def _errors(
    y: torch.Tensor, file_weight: FileWeight, x: torch.Tensor, bias: torch.Tensor | None
) -> tuple[RowErrors, float]:
    """``y`` against float64, next to torch's float32 product with the file's weight;
    and the worst element's error as a fraction of the any-order bound."""
    trusted = functional.linear(x, file_weight.weight, bias)
    exact_bias = None if bias is None else bias.double()
    exact = functional.linear(x.double(), file_weight.exact, exact_bias)
    k = file_weight.exact.shape[1]
    bound = k * FLOAT32_EPS * functional.linear(x.double().abs(), file_weight.magnitude)
    if exact_bias is not None:  # one more addition, of |bias|
        bound += (k + 1) * FLOAT32_EPS * exact_bias.abs()
    worst = ((y.double() - exact).abs() / bound).max().item()
    return row_errors(y, trusted, exact), worst


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@torch.inference_mode()
def test_products_are_float32_close_to_float64(
    variant: str, file_weight: FileWeight, with_bias: bool
) -> None:
    blocks = file_weight.blocks
    n, k = blocks.shape
    noise = torch.Generator().manual_seed(0)
    bias = torch.randn(n, generator=noise) if with_bias else None
    for rows in ROWS:
        x = torch.randn(rows, k, generator=noise)
        y = _product(blocks, x, bias)
        assert y.shape == (rows, n)
        errors, worst = _errors(y, file_weight, x, bias)
        assert errors.ok, (variant, rows, errors)
        assert worst <= 1.0, (variant, rows, worst)


@torch.inference_mode()
def test_a_row_gets_the_same_sum_in_any_tile(variant: str, file_weight: FileWeight) -> None:
    """Rows go in tiles of 8, 4, 2 or 1, a last tile padded with zero rows: each row's
    output is the one it gets alone, bit for bit, whatever the batch, and the padding
    never reaches the output."""
    blocks = file_weight.blocks
    x = torch.randn(17, blocks.shape[1], generator=torch.Generator().manual_seed(3))
    alone = torch.cat([_product(blocks, x[r : r + 1]) for r in range(17)])
    for rows in range(2, 18):
        assert torch.equal(_product(blocks, x[:rows]), alone[:rows]), (variant, rows)


def _one_block_off(blocks: Blocks, row: int, block: int) -> Blocks:
    """``blocks`` with every weight of one block moved by one quantisation step (the
    lowest bit of each 4- or 8-bit weight flipped): the smallest change a block can
    carry."""
    qs = blocks.qs.clone()
    flip = 0x11 if blocks.kind == "q4_1" else 0x01  # two nibbles a byte; one int8
    qs[row, block] = qs[row, block] ^ flip
    return Blocks(blocks.kind, qs, blocks.d, blocks.m)


@torch.inference_mode()
def test_a_block_one_step_off_fails_the_same_check(variant: str, file_weight: FileWeight) -> None:
    """The checks above can fail: one block of one output row, each weight one step off,
    is caught by both."""
    blocks = file_weight.blocks
    n, k = blocks.shape
    wrong = _one_block_off(blocks, row=n // 2, block=k // 64)
    noise = torch.Generator().manual_seed(2)
    for rows in (1, 9):
        x = torch.randn(rows, k, generator=noise)
        errors, worst = _errors(_product(wrong, x), file_weight, x, None)
        assert not errors.ok, (variant, rows, errors)
        assert worst > 1.0, (variant, rows, worst)


def test_bad_arguments_are_refused_naming_them(file_weight: FileWeight) -> None:
    blocks, ops = file_weight.blocks, kernels.ops()
    n, k = blocks.shape
    x = torch.zeros(2, k)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight"):
        ops.block_linear(torch.zeros(2, 32), blocks.qs, blocks.d, blocks.m, None)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.block_linear(torch.zeros(k, 2).t(), blocks.qs, blocks.d, blocks.m, None)
    with pytest.raises(RuntimeError, match="x must be Float, not Double"):
        ops.block_linear(x.double(), blocks.qs, blocks.d, blocks.m, None)
    with pytest.raises(RuntimeError, match=r"weight.d must be \[" + str(n)):
        ops.block_linear(x, blocks.qs, blocks.d[:-1], blocks.m, None)
    with pytest.raises(RuntimeError, match=r"weight\.bias must be"):
        ops.block_linear(x, blocks.qs, blocks.d, blocks.m, torch.zeros(n + 1))
    wrong_m = "Q4_1 blocks need m" if blocks.kind == "q4_1" else "Q8_0 blocks take no m"
    with pytest.raises(RuntimeError, match=wrong_m):
        ops.block_linear(x, blocks.qs, blocks.d, None if blocks.m is not None else blocks.d, None)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.block_dequantize(blocks.qs, blocks.d, blocks.m, torch.empty(n, k + 32))
