"""One product for several linears of the same input (q, k and v; gate and up).

Where all are GGUF blocks of one kind (blocks.py), the blocks are concatenated
by rows once and each original module's buffers become views of its rows, so the
fused weight is not held twice; otherwise their outputs are concatenated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.engines.transformers.weights.blocks import BlockLinear, Blocks


def fuse(modules: list[nn.Module]) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[int]]:
    """One product for several linears of the same input, where all are blocks of one
    kind: the blocks are concatenated by rows and each module's buffers become views
    of its rows (no second copy). Otherwise their outputs are concatenated."""
    sizes = [_out_features(m) for m in modules]
    if all(type(m) is BlockLinear for m in modules) and len({m.kind for m in modules}) == 1:
        blocks = [m for m in modules if isinstance(m, BlockLinear)]
        biases = [m.bias for m in blocks]
        fused = BlockLinear(
            Blocks(
                blocks[0].kind,
                torch.cat([m.qs for m in blocks]),
                torch.cat([m.d for m in blocks]),
                None
                if blocks[0].m is None
                else torch.cat([m.m for m in blocks if m.m is not None]),
            ),
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b if b is not None else m.d.new_zeros(m.out_features)
                    for b, m in zip(biases, blocks, strict=True)
                ]
            ),
            int8=blocks[0].int8,
        )
        start = 0
        for m in blocks:
            end = start + m.out_features
            m.qs, m.d = fused.qs[start:end], fused.d[start:end]
            if fused.m is not None:
                m.m = fused.m[start:end]
            start = end
        return fused, sizes

    def separate(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in modules], dim=-1)

    return separate, sizes


def _out_features(module: nn.Module) -> int:
    features = getattr(module, "out_features", None)
    if not isinstance(features, int):
        raise TypeError(f"{type(module).__name__} has no out_features")
    return features
