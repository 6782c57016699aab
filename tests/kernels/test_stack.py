"""The decode stack, on every kernel variant, is the separate ops run one after another,
bit for bit: the same products, norms, rotary and attention in the same order (the
stack only saves their dispatch and parallel regions). The layers here are random
weights in both block formats, with biases, per-head q/k norms (Qwen3) or not, rows
of one batch with and without padding columns; the test of the stack inside a model
against transformers' forward is the engine's."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import pytest
import torch

from services import kernels
from services.kernels.stack import BlockWeight, DecodeStack, StackLayer, StackShape

LAYERS, HEADS, KV_HEADS, DIM, SIZE, INTER = 3, 4, 2, 16, 64, 96
EPS, HEAD_EPS, SCALE = 1e-5, 1e-6, DIM**-0.5
SHAPE = StackShape(heads=HEADS, kv_heads=KV_HEADS, dim=DIM, size=SIZE, inter=INTER)


def _weight(g: torch.Generator, n: int, k: int, kind: str, bias: bool) -> BlockWeight:
    """``kind``: q4_1 or q8_0, ``_packed`` for the 8-bit products as well (float32
    activations read the file's layout beside it)."""
    blocks = k // 32
    d = (torch.rand(n, blocks, generator=g) * 0.02 + 0.001).half()
    if kind.startswith("q4_1"):
        qs = torch.randint(0, 256, (n, blocks, 16), generator=g, dtype=torch.uint8)
        m = (-8 * d.float() * (1 + 0.1 * torch.randn(n, blocks, generator=g))).half()
    else:
        qs = torch.randint(-128, 128, (n, blocks, 32), generator=g, dtype=torch.int8)
        m = None
    packed = kernels.ops().pack_blocks(qs, d, m) if kind.endswith("_packed") else None
    bias_ = torch.randn(n, generator=g) * 0.1 if bias else None
    return BlockWeight(qs=qs, d=d, m=m, bias=bias_, packed=packed)


@dataclass
class Model:
    layers: list[StackLayer]
    norm: torch.Tensor
    stack: DecodeStack = field(init=False)

    def __post_init__(self) -> None:
        self.stack = DecodeStack.build(self.layers, self.norm, EPS, SHAPE)


def _model(seed: int, kind: str, head_norms: bool) -> Model:
    g = torch.Generator().manual_seed(seed)

    def norm(size: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(size, generator=g)

    layers = [
        StackLayer(
            norm_in=norm(SIZE),
            norm_post=norm(SIZE),
            q_norm=norm(DIM) if head_norms else None,
            k_norm=norm(DIM) if head_norms else None,
            qkv=_weight(g, (HEADS + 2 * KV_HEADS) * DIM, SIZE, kind, bias=True),
            o=_weight(g, SIZE, HEADS * DIM, kind, bias=False),
            gate_up=_weight(g, 2 * INTER, SIZE, kind, bias=False),
            down=_weight(g, SIZE, INTER, kind, bias=False),
            eps_in=EPS,
            eps_post=EPS,
            eps_head=HEAD_EPS,
            scale=SCALE,
        )
        for _ in range(LAYERS)
    ]
    return Model(layers, norm(SIZE))


def _by_ops(model: Model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            column: int, int8: bool = False) -> torch.Tensor:  # fmt: skip
    """The step as separate ops, in the stack's order."""
    ops, rows = kernels.ops(), h.shape[0]

    def _product(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
        return ops.block_linear(x, w.qs, w.d, w.m, w.bias, int8, w.packed)

    delta = None
    for index, layer in enumerate(model.layers):
        x = ops.rms_norm(h, delta, layer.norm_in, EPS)
        qkv = _product(x, layer.qkv)
        heads = qkv.view(rows, -1, DIM)
        for norm, part in (
            (layer.q_norm, slice(0, HEADS)),
            (layer.k_norm, slice(HEADS, HEADS + KV_HEADS)),
        ):
            if norm is not None:
                flat = heads[:, part].reshape(-1, DIM).contiguous()
                heads[:, part] = ops.rms_norm(flat, None, norm, HEAD_EPS).view(rows, -1, DIM)
        ops.rotary_(qkv, HEADS + KV_HEADS, DIM, cos, sin)
        keys[index, :, :, column] = heads[:, HEADS : HEADS + KV_HEADS]
        values[index, :, :, column] = heads[:, HEADS + KV_HEADS :]
        seen = slice(0, column + 1)
        att = ops.attend_one(heads[:, :HEADS], keys[index, :, :, seen], values[index, :, :, seen],
                             mask, SCALE)  # fmt: skip
        x = ops.rms_norm(h, _product(att, layer.o), layer.norm_post, EPS)
        delta = _product(ops.silu_mul(_product(x, layer.gate_up)), layer.down)
    return ops.rms_norm(h, delta, model.norm, EPS)


def _inputs(rows: int, column: int, room: int, padded: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, SIZE, generator=g)
    angles = torch.rand(rows, DIM // 2, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys = torch.randn(LAYERS, rows, KV_HEADS, room, DIM, generator=g)
    values = torch.randn(LAYERS, rows, KV_HEADS, room, DIM, generator=g)
    mask = None
    if padded:
        mask = (torch.rand(rows, column + 1, generator=g) < 0.7).to(torch.uint8)
        mask[:, -1] = 1
    return h, cos, sin, keys, values, mask


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("head_norms", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_1_packed", "q8_0_packed"])
@pytest.mark.parametrize(("rows", "padded"), [(1, False), (3, True), (8, False), (13, True)])
@torch.inference_mode()
def test_the_stack_is_the_separate_ops_bit_for_bit(
    variant: str, kind: str, head_norms: bool, rows: int, padded: bool, int8: bool
) -> None:
    """On float32 activations and on 8-bit ones (every product rounding its input)."""
    model = _model(rows, kind, head_norms)
    column, room = 20, 24
    h, cos, sin, keys, values, mask = _inputs(rows, column, room, padded, seed=rows + 1)
    mine_h, mine_keys, mine_values = h.clone(), keys.clone(), values.clone()
    states = model.stack.step(mine_h, cos, sin, mine_keys, mine_values, mask, column, int8)
    expected = _by_ops(model, h, cos, sin, keys, values, mask, column, int8)
    assert torch.equal(states, expected), variant
    assert torch.equal(mine_h, h)  # the residual stream, added into in place
    assert torch.equal(mine_keys, keys) and torch.equal(mine_values, values)
    assert not torch.equal(states, torch.zeros_like(states))


@torch.inference_mode()
def test_a_step_writes_its_column_and_leaves_the_others(variant: str) -> None:
    model = _model(0, "q4_1", head_norms=False)
    h, cos, sin, keys, values, mask = _inputs(2, 5, 9, padded=False, seed=0)
    before = keys.clone()
    model.stack.step(h, cos, sin, keys, values, mask, 5)
    changed = (keys != before).any(dim=(0, 1, 2, 4))
    assert changed.tolist() == [c == 5 for c in range(9)]


def test_bad_arguments_are_refused_naming_them() -> None:
    model = _model(0, "q4_1", head_norms=False)
    ops = kernels.ops()
    stack = model.stack.handle  # around the typed face: C++ checks a step's tensors itself
    h, cos, sin, keys, values, mask = _inputs(2, 5, 9, padded=True, seed=0)
    with pytest.raises(RuntimeError, match=r"h must be \[rows >= 1, 64\]"):
        ops.decode_stack(stack, h[:, :32].contiguous(), cos, sin, keys, values, mask, 5)
    with pytest.raises(RuntimeError, match=r"cos must be \[2, 16\]"):
        ops.decode_stack(stack, h, cos[:1], sin, keys, values, mask, 5)
    with pytest.raises(RuntimeError, match=r"mask must be \[2, 6\]"):
        ops.decode_stack(stack, h, cos, sin, keys, values, mask[:, :5].contiguous(), 5)
    with pytest.raises(RuntimeError, match="column 9 is outside a cache of 9 columns"):
        ops.decode_stack(stack, h, cos, sin, keys, values, None, 9)
    with pytest.raises(RuntimeError, match=r"keys must be \[3, 2, 2, room, 16\]"):
        ops.decode_stack(stack, h, cos, sin, keys[:2], values[:2], None, 5)
    with pytest.raises(RuntimeError, match="keys and values must have one shape"):
        ops.decode_stack(stack, h, cos, sin, keys, values[..., :8, :], None, 5)


def test_bad_weights_are_refused_when_the_stack_is_built() -> None:
    good = _model(0, "q8_0", head_norms=False)
    wide = _weight(torch.Generator().manual_seed(1), SIZE, 2 * HEADS * DIM, "q8_0", bias=False)
    layers = list(good.layers)
    layers[1] = replace(good.layers[1], o=wide)
    with pytest.raises(ValueError, match=r"layer 1 o is \[64, 128\], its role needs \[64, 64\]$"):
        Model(layers, good.norm)
    # C++ checks as much itself, for a caller that goes around the typed face.
    tensors, scalars = [], []
    for layer in layers:
        more, numbers = layer.flat()
        tensors += more
        scalars += numbers
    dims = [LAYERS, HEADS, KV_HEADS, DIM, SIZE, INTER]
    with pytest.raises(RuntimeError, match="layer 1 o is 64 x 128, not 64 x 64"):
        torch.classes.omni_kernels.DecodeStack([*tensors, good.norm], [*scalars, EPS], dims)
    layers[1] = replace(good.layers[1], norm_in=torch.ones(SIZE + 1))
    with pytest.raises(ValueError, match=r"layer 1 norm_in is \[65\], its role needs \[64\]$"):
        Model(layers, good.norm)
    with pytest.raises(ValueError, match=r"the final norm is \[65\], it needs \[64\]"):
        Model(good.layers, torch.ones(SIZE + 1))
    with pytest.raises(RuntimeError, match="takes 73 tensors and 13 scalars"):
        torch.classes.omni_kernels.DecodeStack([None], [1.0], dims)


def test_a_part_given_in_anothers_place_is_refused_naming_both() -> None:
    """Parts are named, never placed by order: one given in another's place has the
    wrong shape for its role (refused, naming the role its shape is), or, for the two
    norms of one shape, cannot be given without its name."""
    good = _model(0, "q4_1", head_norms=True)
    layer = good.layers[0]
    swaps = {
        "qkv": (
            {"qkv": layer.gate_up, "gate_up": layer.qkv},
            r"\[192, 64\]",
            "[128, 64]",
            "gate_up",
        ),
        "o": ({"o": layer.down, "down": layer.o}, r"\[64, 96\]", "[64, 64]", "down"),
        "q_norm": ({"q_norm": layer.norm_in}, r"\[64\]", "[16]", "norm_in or norm_post"),
    }
    for role, (parts, has, needs, alike) in swaps.items():
        wrong = [replace(layer, **parts), *good.layers[1:]]  # type: ignore[arg-type]
        message = (
            f"layer 0 {role} is {has}, its role needs {re.escape(needs)} "
            f"\\(the shape of {alike}: given in its place\\?\\)"
        )
        with pytest.raises(ValueError, match=message):
            Model(wrong, good.norm)
    with pytest.raises(TypeError, match="positional"):
        StackLayer(layer.norm_post, layer.norm_in)


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_1_packed", "q8_0_packed"])
@pytest.mark.parametrize(
    ("column", "positions", "masked"), [(0, 1, False), (0, 13, False), (6, 9, False), (6, 9, True)]
)
@torch.inference_mode()
def test_a_sequence_is_its_positions_stepped_one_by_one_bit_for_bit(
    variant: str, kind: str, column: int, positions: int, masked: bool, int8: bool
) -> None:
    """A prefill of one cache row: ``positions`` rows in one call, each attending the
    columns up to its own (those its mask sets), equal to that many one-row steps at
    columns column, column + 1, ...: every final state, every cache column, the
    residual stream."""
    model = _model(positions, kind, head_norms=kind.startswith("q8_0"))
    room = column + positions + 3
    h, cos, sin, keys, values, _mask = _inputs(positions, column, room, False, seed=positions)
    keys, values = keys[:, :1].contiguous(), values[:, :1].contiguous()
    before = keys.clone()
    mask = None
    if masked:  # padding among the earlier columns
        mask = torch.ones(1, column + positions, dtype=torch.uint8)
        mask[0, [1, 4]] = 0
    mine_h, mine_keys, mine_values = h.clone(), keys.clone(), values.clone()
    states = model.stack.step(mine_h, cos, sin, mine_keys, mine_values, mask, column, int8,
                              sequence=True)  # fmt: skip
    stepped = []
    for r in range(positions):
        row = h[r : r + 1].clone()
        seen = None if mask is None else mask[:, : column + r + 1].contiguous()
        stepped.append(model.stack.step(row, cos[r : r + 1], sin[r : r + 1], keys, values,
                                        seen, column + r, int8))  # fmt: skip
        h[r] = row[0]
    assert torch.equal(states, torch.cat(stepped)), variant
    assert torch.equal(mine_h, h)
    assert torch.equal(mine_keys, keys) and torch.equal(mine_values, values)
    written = (mine_keys != before).any(dim=(0, 1, 2, 4))
    assert written.tolist() == [column <= c < column + positions for c in range(room)]
    if masked:  # the mask mattered: without it the answer is another
        unmasked = model.stack.step(h.clone(), cos, sin, keys.clone(), values.clone(), None,
                                    column, int8, sequence=True)  # fmt: skip
        assert not torch.equal(unmasked, states)


def test_a_sequence_is_refused_a_wrong_mask_and_columns_past_the_cache() -> None:
    model = _model(0, "q4_1", head_norms=False)
    h, cos, sin, keys, values, mask = _inputs(4, 3, 8, padded=True, seed=0)
    keys, values = keys[:, :1].contiguous(), values[:, :1].contiguous()
    with pytest.raises(RuntimeError, match=r"a sequence's mask must be \[1, 7\]"):
        model.stack.step(h, cos, sin, keys, values, mask, 3, sequence=True)
    with pytest.raises(RuntimeError, match=r"columns 5\.\.8 are outside a cache of 8 columns"):
        model.stack.step(h, cos, sin, keys, values, None, 5, sequence=True)
    with pytest.raises(RuntimeError, match=r"keys must be \[3, 1, 2, room, 16\]"):
        wide = torch.zeros(LAYERS, 2, KV_HEADS, 8, DIM)
        model.stack.step(h, cos, sin, wide, wide.clone(), None, 0, sequence=True)
