"""Linear layers that keep a GGUF file's own weight blocks (Q4_1, Q8_0) on the CPU.

A decode step reads every weight once per token, so on a CPU its speed is the bytes
per weight: float32 reads 32 bits, the file's Q4_1 blocks 5 (4-bit weights, a
float16 scale and min per 32, kept as they are). The kernels (services/kernels)
multiply float32 activations straight from those blocks, each weight dequantised
exactly as the plain path dequantised it at conversion, ``(d * q) + m`` in float32
(the answers are float32's up to the order of the additions), or (``int8``) the
activations rounded to 8 bits per block as llama.cpp does and multiplied with integer
dot products; ``benchmarks/precision_agreement.py`` measures the greedy agreement of
each.

Products of many rows (a prefill) on float32 activations dequantise the weight into a
scratch float32 matrix and hand it to torch's GEMM, which is faster there than the
row-tiled kernel.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from services import kernels

QK = 32  # weights per block, both formats
# Rows from which a product dequantises the weight (into a reused scratch) for
# torch's GEMM instead. A prefill's weights come from memory, not cache: over all of
# SmolLM2-135M's layers the kernel was faster than dequantise + GEMM up to 128 rows
# and no faster from 192 (docs/benchmarks.md).
MANY_ROWS = 128
# The rows a packed group holds (the kernels' PACK_ROWS): a weight of a multiple of
# it runs its 8-bit products on the packed layout.
PACK_ROWS = 16
# GGML type ids (gguf.GGMLQuantizationType) and bytes per block.
Q4_1, Q8_0 = 3, 8
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


@dataclass
class Blocks:
    """One weight in blocks: ``qs`` [n][k/32][16] uint8 (Q4_1) or [n][k/32][32] int8
    (Q8_0); ``d`` (and ``m`` for Q4_1) float16 [n][k/32], as in the file (other dtypes
    are rounded to it)."""

    kind: str  # "q4_1" | "q8_0"
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def __post_init__(self) -> None:
        self.d = self.d.to(torch.float16).contiguous()
        if self.m is not None:
            self.m = self.m.to(torch.float16).contiguous()

    @classmethod
    def of_gguf(cls, raw: np.ndarray, ggml_type: int) -> Blocks:
        """A GGUF tensor's raw bytes ([n][bytes per row], uint8) as blocks."""
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, BLOCK_BYTES[ggml_type])
        if ggml_type == Q4_1:
            return cls("q4_1", _bytes(blocks[..., 4:]), _half(blocks[..., 0:2]),
                       _half(blocks[..., 2:4]))  # fmt: skip
        qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return cls("q8_0", torch.from_numpy(qs), _half(blocks[..., 0:2]), None)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK

    def rows(self, order: torch.Tensor) -> Blocks:
        """These blocks with their rows in ``order``."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, order).contiguous()

        return Blocks(
            self.kind, pick(self.qs), pick(self.d), None if self.m is None else pick(self.m)
        )

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.shape) if out is None else out
        kernels.ops().block_dequantize(self.qs, self.d, self.m, out)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def _bytes(column: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(column))


def _half(column: np.ndarray) -> torch.Tensor:
    """A [..., 2] uint8 slice holding float16s, as float16 [...]."""
    return torch.from_numpy(np.ascontiguousarray(column).view(np.float16)[..., 0].copy())


class BlockLinear(nn.Module):
    """``nn.Linear``'s forward over a weight held in GGUF blocks (float32 in and out)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, int8: bool = False) -> None:
        super().__init__()
        # activations rounded to 8 bits for the kernels' integer products (config.py's
        # engine_args.activations), at any number of rows: a row's answer must not
        # depend on how many rows share its product
        self.int8 = int8
        self.out_features, self.in_features = blocks.shape
        self.kind = blocks.kind
        self.register_buffer("qs", blocks.qs, persistent=False)
        self.register_buffer("d", blocks.d, persistent=False)
        self.register_buffer("m", blocks.m, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self._packed: torch.Tensor | None = None

    @property
    def packed(self) -> torch.Tensor | None:
        """On 8-bit activations, a weight of a multiple of PACK_ROWS rows laid out for
        the kernels' integer products (kernels.h: pack_blocks; the same bytes,
        rearranged so that a vector's lanes are 16 rows: a third of the instructions a
        block), made on first use and kept beside the file's layout (the reference
        kernels and the float32 products read that). None otherwise."""
        if not self.int8 or self.out_features % PACK_ROWS:
            return None
        if self._packed is None:
            self._packed = kernels.ops().pack_blocks(self.qs, self.d, self.m)
        return self._packed

    @property
    def blocks(self) -> Blocks:
        return Blocks(self.kind, self.qs, self.d, self.m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        if x2.shape[0] >= MANY_ROWS and not self.int8:
            weight = self.blocks.dequantize(_scratch(self.out_features, self.in_features))
            y = nn.functional.linear(x2, weight, self.bias)
        else:
            y = kernels.ops().block_linear(
                x2, self.qs, self.d, self.m, self.bias, self.int8, self.packed
            )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} blocks"
            + (", int8 activations" if self.int8 else "")
        )


_SCRATCH = threading.local()
SCRATCH_KEPT = 4 << 20  # floats: 16 MiB, four times a 1536 x 576 projection


def _scratch(n: int, k: int) -> torch.Tensor:
    """A float32 [n][k] to dequantise a weight into for one product, reused by this
    thread's next one: a fresh allocation of megabytes costs its page faults every
    time (more than the dequantisation). Weights past SCRATCH_KEPT (a tied output head
    over a big vocabulary) get a fresh one, so that none is held for good."""
    if n * k > SCRATCH_KEPT:
        return torch.empty(n, k)
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < n * k:
        buffer = _SCRATCH.buffer = torch.empty(n * k)
    return buffer[: n * k].view(n, k)
