"""A decode step's layer stack, built layer by layer from named parts.

The C++ ``DecodeStack`` (csrc/stack_op.cpp) takes each layer's 24 tensors and 4
scalars as one flat list, by position. Here a layer is a ``StackLayer`` whose parts
are named (keywords only: two norms of one shape cannot trade places by order), each
checked against the shape its role needs before anything reaches C++, and
``DecodeStack.build`` is the one place the flat lists are made, from the names in
``TENSORS`` and ``SCALARS``: the order stack_op.cpp reads them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kernels.library import ops

# A block weight's parts, in stack_op.cpp's order.
WEIGHT_PARTS = ("qs", "d", "m", "bias", "packed")
# A layer's tensors (a weight standing for its five parts) and scalars, in
# stack_op.cpp's order: 4 + 4 * 5 = its TENSORS (24), and its SCALARS (4).
TENSORS = ("norm_in", "norm_post", "q_norm", "k_norm", "qkv", "o", "gate_up", "down")
SCALARS = ("eps_in", "eps_post", "eps_head", "scale")
BLOCK = 32  # weights per GGUF block (Q4_1, Q8_0)


@dataclass(frozen=True, kw_only=True)
class BlockWeight:
    """One linear on GGUF blocks, [n, k]: ``qs`` its quants ([n, k / 32, 16] uint8
    for Q4_1, [n, k / 32, 32] int8 for Q8_0), ``d`` its scales and ``m`` its mins
    (Q4_1) [n, k / 32] float16, ``bias`` [n] float32 or None; ``packed`` the same
    weight laid out for the 8-bit products (``pack_blocks``) or None."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """[n, k] as its scales give it (the kernels check its quants against them)."""
        if self.d.dim() != 2:
            return (-1, -1)
        return int(self.d.shape[0]), int(self.d.shape[1]) * BLOCK


@dataclass(frozen=True)
class StackShape:
    """The model's dimensions, which fix the shape each role of a layer needs."""

    heads: int
    kv_heads: int
    dim: int  # per head
    size: int  # hidden
    inter: int  # the MLP's

    def roles(self) -> dict[str, tuple[int, ...]]:
        """Each role's shape: a norm's [length], a weight's [n, k]."""
        heads, kv_heads, dim, size, inter = (
            self.heads, self.kv_heads, self.dim, self.size, self.inter,
        )  # fmt: skip
        return {
            "norm_in": (size,),
            "norm_post": (size,),
            "q_norm": (dim,),
            "k_norm": (dim,),
            "qkv": ((heads + 2 * kv_heads) * dim, size),
            "o": (size, heads * dim),
            "gate_up": (2 * inter, size),
            "down": (size, inter),
        }


@dataclass(frozen=True, kw_only=True)
class StackLayer:
    """One decoder layer as the stack runs it: its RMSNorms (float32), its four block
    weights (q, k, v fused; gate, up fused), their epsilons and the attention scale.
    ``q_norm`` / ``k_norm`` are Qwen3's per-head norms, None for Llama's."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: BlockWeight
    o: BlockWeight
    gate_up: BlockWeight
    down: BlockWeight
    eps_in: float
    eps_post: float
    scale: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps_head: float = 0.0

    def check(self, shape: StackShape, where: str) -> None:
        """Each part has the shape of its role; ValueError naming the part, the shape
        it has, and the role that shape is (a part given in another's place) if any."""
        roles = shape.roles()
        for name in TENSORS:
            part = getattr(self, name)
            if part is None:
                continue
            has = part.shape if isinstance(part, BlockWeight) else tuple(part.shape)
            if has == roles[name]:
                continue
            alike = [r for r, want in roles.items() if want == tuple(has) and r != name]
            hint = f" (the shape of {' or '.join(alike)}: given in its place?)" if alike else ""
            raise ValueError(
                f"{where} {name} is {list(has)}, its role needs {list(roles[name])}{hint}"
            )

    def flat(self) -> tuple[list[torch.Tensor | None], list[float]]:
        """The layer's tensors and scalars in stack_op.cpp's order."""
        tensors: list[torch.Tensor | None] = []
        for name in TENSORS:
            part = getattr(self, name)
            if isinstance(part, BlockWeight):
                tensors += [getattr(part, p) for p in WEIGHT_PARTS]
            else:
                tensors.append(part)
        return tensors, [float(getattr(self, name)) for name in SCALARS]


@dataclass(frozen=True)
class DecodeStack:
    """The kernels' stack over a model's layers, every part checked once, here and in
    C++; ``step`` runs one decode step over it."""

    handle: torch.ScriptObject
    layers: int
    shape: StackShape

    @classmethod
    def build(
        cls, layers: Sequence[StackLayer], norm: torch.Tensor, eps: float, shape: StackShape
    ) -> DecodeStack:
        """The stack of ``layers`` and the final ``norm`` ([size] float32, ``eps``)."""
        if not layers:
            raise ValueError("a decode stack needs at least one layer")
        tensors: list[torch.Tensor | None] = []
        scalars: list[float] = []
        for index, layer in enumerate(layers):
            layer.check(shape, f"layer {index}")
            more, numbers = layer.flat()
            tensors += more
            scalars += numbers
        if tuple(norm.shape) != (shape.size,):
            raise ValueError(f"the final norm is {list(norm.shape)}, it needs [{shape.size}]")
        ops()  # loads the library that registers the class
        dims = [len(layers), shape.heads, shape.kv_heads, shape.dim, shape.size, shape.inter]
        handle = torch.classes.omni_kernels.DecodeStack([*tensors, norm], [*scalars, eps], dims)
        return cls(handle, len(layers), shape)

    def step(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        column: int,
        int8: bool = False,
        sequence: bool = False,
    ) -> torch.Tensor:
        """One step: ``h`` [rows, size] (added into), ``cos``/``sin`` [rows, dim], the
        cache's ``keys``/``values`` [layers, rows, kv_heads, room, dim] (column
        ``column`` written), ``mask`` uint8 [rows, column + 1] or None. The final
        norm's output [rows, size].

        As a ``sequence`` (a prefill): ``h``'s rows are the positions ``column`` to
        ``column + rows - 1`` of a cache of one row (``keys``/``values`` [layers, 1,
        kv_heads, room, dim], ``mask`` [1, column + rows] or None), each attending the
        columns up to its own; bit for bit ``rows`` one-row steps, in one call."""
        return ops().decode_stack(
            self.handle, h, cos, sin, keys, values, mask, column, int8, sequence
        )
