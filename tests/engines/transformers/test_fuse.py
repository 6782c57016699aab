"""``fuse``: one product for the linears of one input (q/k/v, gate/up) where they are
GGUF blocks of one kind, with the layers' own buffers turned into views of the fused
blocks; otherwise each layer runs as it was. Small random blocks, both formats,
both of BlockLinear's paths (the row kernel, and the dequantised GEMM from
MANY_ROWS rows)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.engines.transformers.weights.blocks import MANY_ROWS, QK, BlockLinear, Blocks
from services.engines.transformers.weights.fused import fuse
from tests.helpers.float_error import assert_float32_close

IN = 2 * QK


def blocks(kind: str, rows: int, seed: int) -> Blocks:
    g = torch.Generator().manual_seed(seed)
    if kind == "q4_1":
        qs = torch.randint(0, 256, (rows, IN // QK, QK // 2), dtype=torch.uint8, generator=g)
        m: torch.Tensor | None = torch.randn(rows, IN // QK, generator=g)
    else:
        qs = torch.randint(-128, 128, (rows, IN // QK, QK), dtype=torch.int8, generator=g)
        m = None
    return Blocks(kind, qs, torch.rand(rows, IN // QK, generator=g), m)


def layers(kind: str, biases: tuple[bool, ...]) -> list[nn.Module]:
    """Linears of 8, 4 and 4 rows (q, k, v), some with a bias."""
    out: list[nn.Module] = []
    for index, (rows, has_bias) in enumerate(zip((8, 4, 4), biases, strict=False)):
        bias = torch.randn(rows, generator=torch.Generator().manual_seed(100 + index))
        out.append(BlockLinear(blocks(kind, rows, index), bias if has_bias else None))
    return out


def _weight(module: nn.Module) -> torch.Tensor:
    assert isinstance(module, BlockLinear)
    return Blocks(module.kind, module.qs, module.d, module.m).dequantize().double()


def _bias(module: nn.Module) -> torch.Tensor | float:
    assert isinstance(module, BlockLinear)
    return 0.0 if module.bias is None else module.bias.double()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("biases", [(False, False, False), (True, False, True)])
@pytest.mark.parametrize("rows", [3, MANY_ROWS + 4])
@torch.inference_mode()
def test_fused_blocks_give_each_layers_product_and_share_its_storage(
    kind: str, biases: tuple[bool, ...], rows: int
) -> None:
    modules = layers(kind, biases)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(7))
    before = [m(x) for m in modules]
    fused, sizes = fuse(modules)
    assert isinstance(fused, BlockLinear) and sizes == [8, 4, 4]
    # The same dot products, summed in another blocking where the kernel tiles or
    # the GEMM blocks differently for more output rows: float32 rounding apart.
    exact = [x.double() @ _weight(m).T + _bias(m) for m in modules]
    assert_float32_close(fused(x), torch.cat(before, -1), torch.cat(exact, -1))
    for module, alone in zip(modules, before, strict=True):
        assert torch.equal(module(x), alone)  # the layers still run, from the views
        for name in ("qs", "d", "m"):
            mine, whole = getattr(module, name), getattr(fused, name)
            assert (mine is None) == (whole is None)
            if mine is not None:
                assert mine.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


@torch.inference_mode()
def test_layers_of_mixed_kinds_or_plain_linears_run_apart() -> None:
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(7))
    q4, q8 = layers("q4_1", (True,))[0], layers("q8_0", (False,))[0]
    plain = nn.Linear(IN, 4)
    for modules in ([q4, q8], [q4, plain]):
        qs = [m.qs for m in modules if isinstance(m, BlockLinear)]
        before = [m(x) for m in modules]
        joined, sizes = fuse(modules)
        assert not isinstance(joined, BlockLinear)
        assert sizes == [m.out_features for m in modules]
        assert torch.equal(joined(x), torch.cat(before, dim=-1))
        after = [m.qs for m in modules if isinstance(m, BlockLinear)]
        assert all(a is b for a, b in zip(after, qs, strict=True))  # left alone
