"""The kernels' ops as Python sees them: one typed method per op that ops.cpp and
stack_op.cpp register under ``torch.ops.omni_kernels`` (their schemas, in the same
order), so that a caller's mistake is mypy's to find, not a run's. ``library.ops()``
returns the loaded library as this protocol."""

from __future__ import annotations

from typing import Protocol

import torch


class KernelOps(Protocol):
    # -- the library: its variants and its build ---------------------------------

    def variant(self) -> str: ...

    def variants(self) -> list[str]: ...

    def supports(self, name: str) -> bool: ...

    def needs(self, name: str) -> str: ...

    def use(self, name: str) -> None: ...

    def build_hash(self) -> str: ...

    # -- GGUF block products ------------------------------------------------------

    def block_linear(
        self,
        x: torch.Tensor,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor | None,
        bias: torch.Tensor | None,
        int8: bool = False,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, k] float32 times the blocks' [n, k] weight, transposed: [rows, n];
        on 8-bit activations over ``packed`` (``pack_blocks``' of the same weight) where
        given and the variant has packed products."""
        ...

    def pack_blocks(
        self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
    ) -> torch.Tensor:
        """A weight of a multiple of 16 rows laid out for the 8-bit products: uint8
        [n / 16, k / 32, 320] (Q4_1) or [n / 16, k / 32, 544] (Q8_0)."""
        ...

    def quantize_q8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x's rows rounded to 8 bits as every 8-bit product rounds them: q int8
        [rows, k], d and s float32 [rows, k / 32]."""
        ...

    def block_dequantize(
        self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """The blocks' weight into ``out`` [n, k] float32."""
        ...

    # -- a decoder layer's float32 glue --------------------------------------------

    def rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``h += delta`` (in place, when given), then h's RMSNorm times ``weight``."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary_(
        self, x: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> None: ...

    def attend_one(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor: ...

    # -- a decode step's layer stack (built by services/kernels/stack.py) --------------

    def decode_stack(
        self,
        stack: torch.ScriptObject,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        column: int,
        int8: bool = False,
        sequence: bool = False,
    ) -> torch.Tensor: ...
