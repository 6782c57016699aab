"""A Q4_1 weight packed for the 8-bit products (kernels.h: pack_q4_1): the layout's
own properties. How close its products are to the exact sum, per variant, is
test_q8.py's (``layout`` packed); that the decode stack over packed weights is the
separate ops bit for bit, test_stack.py's (``q4_1_packed``)."""

from __future__ import annotations

import pytest
import torch

from services import kernels
from tests.kernels.conftest import FileWeight

RECORD = 320  # bytes of one group's block: 16 rows' 16 quant bytes, their d and m


def _packed(file_weight: FileWeight) -> torch.Tensor:
    blocks = file_weight.blocks
    if blocks.kind != "q4_1":
        pytest.skip("only Q4_1 weights are packed")
    assert blocks.m is not None
    return kernels.ops().pack_q4_1(blocks.qs, blocks.d, blocks.m)


def test_the_packed_weight_is_the_files_bytes_rearranged(file_weight: FileWeight) -> None:
    """Record (g, j): chunk t holds rows 16g..16g+15's block-j bytes 4t..4t+3 side by
    side, then the 16 rows' d, then their m. Read back by that rule, every quant byte,
    scale and minimum is the file's, none twice."""
    packed = _packed(file_weight)
    blocks = file_weight.blocks
    n, k = blocks.shape
    assert tuple(packed.shape) == (n // 16, k // 32, RECORD)
    records = packed.view(n // 16, k // 32, RECORD)
    quants = records[..., :256].reshape(n // 16, k // 32, 4, 16, 4)  # g, j, t, row, byte
    back = quants.permute(0, 3, 1, 2, 4).reshape(n, k // 32, 16)
    assert torch.equal(back, blocks.qs)
    scales = records[..., 256:].contiguous().view(torch.float16).view(n // 16, k // 32, 2, 16)
    assert blocks.m is not None
    assert torch.equal(scales[:, :, 0].permute(0, 2, 1).reshape(n, k // 32), blocks.d)
    assert torch.equal(scales[:, :, 1].permute(0, 2, 1).reshape(n, k // 32), blocks.m)


@torch.inference_mode()
def test_every_vector_variant_gives_the_same_packed_sums(file_weight: FileWeight) -> None:
    """The packed products add in one order on 256 and 512 bits, with VNNI or without
    (exact integer dots, then the same float32 operations a block): bit for bit alike."""
    packed = _packed(file_weight)
    blocks = file_weight.blocks
    vector = [v for v in kernels.runnable() if v != "reference"]
    if len(vector) < 2:
        pytest.skip(f"one vector variant runs here ({vector}): nothing to compare")
    x = torch.randn(11, blocks.shape[1], generator=torch.Generator().manual_seed(5))
    sums = {}
    for name in vector:
        with kernels.using(name):
            sums[name] = kernels.ops().block_linear(x, blocks.qs, blocks.d, blocks.m, None, True,
                                                    packed)  # fmt: skip
    first = sums[vector[0]]
    for name in vector[1:]:
        assert torch.equal(sums[name], first), (vector[0], name)


def test_what_cannot_be_packed_is_refused_by_name() -> None:
    ops = kernels.ops()
    g = torch.Generator().manual_seed(0)
    qs = torch.randint(0, 256, (24, 2, 16), generator=g, dtype=torch.uint8)
    d = torch.rand(24, 2, generator=g).half()
    with pytest.raises(RuntimeError, match="24 rows are not a multiple of 16"):
        ops.pack_q4_1(qs, d, d)
    q8 = torch.zeros(16, 2, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="Q8_0 blocks take no m"):
        ops.pack_q4_1(q8, d[:16], d[:16])
    packed = ops.pack_q4_1(qs[:16], d[:16], d[:16])
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match=r"weight.packed must be \[1, 2, 320\]"):
        ops.block_linear(x, qs[:16], d[:16], d[:16], None, True, packed[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="only Q4_1 weights of a multiple of 16 rows"):
        ops.block_linear(x, q8, d[:16], None, None, True, packed)
