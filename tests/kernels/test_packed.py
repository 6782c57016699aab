"""A weight packed for the 8-bit products (kernels.h: pack_blocks): the layout's own
properties. How close its products are to the exact sum, per variant, is test_q8.py's
(``layout`` packed); that the decode stack over packed weights is the separate ops
bit for bit, test_stack.py's (``q4_1_packed``, ``q8_0_packed``)."""

from __future__ import annotations

import pytest
import torch

from services import kernels
from tests.kernels.conftest import FileWeight

# bytes of one group's block: 16 rows' quants, their d (and Q4_1's m)
RECORD = {"q4_1": 320, "q8_0": 544}


def _packed(file_weight: FileWeight) -> torch.Tensor:
    blocks = file_weight.blocks
    return kernels.ops().pack_blocks(blocks.qs, blocks.d, blocks.m)


def test_the_packed_weight_is_the_files_bytes_rearranged(file_weight: FileWeight) -> None:
    """Record (g, j): chunk t holds rows 16g..16g+15's block-j bytes 4t..4t+3 side by
    side, then the 16 rows' d (and m). Read back by that rule, every quant byte, scale
    and minimum is the file's, none twice."""
    packed = _packed(file_weight)
    blocks = file_weight.blocks
    n, k = blocks.shape
    width = blocks.qs.shape[2]  # quant bytes a block: 16 (Q4_1) or 32 (Q8_0)
    assert tuple(packed.shape) == (n // 16, k // 32, RECORD[blocks.kind])
    quants = packed[..., : 16 * width].reshape(n // 16, k // 32, width // 4, 16, 4)
    back = quants.permute(0, 3, 1, 2, 4).reshape(n, k // 32, width)
    assert torch.equal(back.view(blocks.qs.dtype), blocks.qs)
    scales = packed[..., 16 * width :].contiguous().view(torch.float16)
    scales = scales.view(n // 16, k // 32, -1, 16).permute(2, 0, 3, 1).reshape(-1, n, k // 32)
    kept = [blocks.d] + ([] if blocks.m is None else [blocks.m])
    assert len(scales) == len(kept)
    for got, want in zip(scales, kept, strict=True):
        assert torch.equal(got, want)


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
        ops.pack_blocks(qs, d, d)
    q8 = torch.zeros(16, 2, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="Q8_0 blocks take no m"):
        ops.pack_blocks(q8, d[:16], d[:16])
    packed = ops.pack_blocks(qs[:16], d[:16], d[:16])
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match=r"weight.packed must be \[1, 2, 320\]"):
        ops.block_linear(x, qs[:16], d[:16], d[:16], None, True, packed[:, :1].contiguous())
    with pytest.raises(RuntimeError, match=r"weight.packed must be \[1, 2, 544\]"):
        ops.block_linear(x, q8, d[:16], None, None, True, packed)
    with pytest.raises(RuntimeError, match="only weights of a multiple of 16 rows are packed"):
        ops.block_linear(x, qs, d, d, None, True, packed)
