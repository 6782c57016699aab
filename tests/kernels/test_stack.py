"""The decode stack, on every kernel variant, is the separate ops run one after another,
bit for bit: the same products, norms, rotary and attention in the same order (the
stack only saves their dispatch and parallel regions). The layers here are random
weights in both block formats, with biases, per-head q/k norms (Qwen3) or not, rows
of one batch with and without padding columns; the test of the stack inside a model
against transformers' forward is the engine's."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from services import kernels

LAYERS, HEADS, KV_HEADS, DIM, SIZE, INTER = 3, 4, 2, 16, 64, 96
EPS, HEAD_EPS, SCALE = 1e-5, 1e-6, DIM**-0.5


@dataclass
class Weight:
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def tensors(self) -> list[torch.Tensor | None]:
        return [self.qs, self.d, self.m, self.bias]


def _weight(g: torch.Generator, n: int, k: int, kind: str, bias: bool) -> Weight:
    blocks = k // 32
    d = (torch.rand(n, blocks, generator=g) * 0.02 + 0.001).half()
    if kind == "q4_1":
        qs = torch.randint(0, 256, (n, blocks, 16), generator=g, dtype=torch.uint8)
        m = (-8 * d.float() * (1 + 0.1 * torch.randn(n, blocks, generator=g))).half()
    else:
        qs = torch.randint(-128, 128, (n, blocks, 32), generator=g, dtype=torch.int8)
        m = None
    return Weight(qs, d, m, torch.randn(n, generator=g) * 0.1 if bias else None)


@dataclass
class Layer:
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Weight
    o: Weight
    gate_up: Weight
    down: Weight


@dataclass
class Model:
    layers: list[Layer]
    norm: torch.Tensor
    stack: object = field(init=False)

    def __post_init__(self) -> None:
        tensors: list[torch.Tensor | None] = []
        scalars: list[float] = []
        for layer in self.layers:
            tensors += [layer.norm_in, layer.norm_post, layer.q_norm, layer.k_norm]
            for weight in (layer.qkv, layer.o, layer.gate_up, layer.down):
                tensors += weight.tensors
            scalars += [EPS, EPS, HEAD_EPS, SCALE]
        dims = [len(self.layers), HEADS, KV_HEADS, DIM, SIZE, INTER]
        self.stack = torch.classes.omni_kernels.DecodeStack(
            [*tensors, self.norm], [*scalars, EPS], dims
        )


def _model(seed: int, kind: str, head_norms: bool) -> Model:
    g = torch.Generator().manual_seed(seed)

    def norm(size: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(size, generator=g)

    layers = [
        Layer(
            norm(SIZE),
            norm(SIZE),
            norm(DIM) if head_norms else None,
            norm(DIM) if head_norms else None,
            _weight(g, (HEADS + 2 * KV_HEADS) * DIM, SIZE, kind, bias=True),
            _weight(g, SIZE, HEADS * DIM, kind, bias=False),
            _weight(g, 2 * INTER, SIZE, kind, bias=False),
            _weight(g, SIZE, INTER, kind, bias=False),
        )
        for _ in range(LAYERS)
    ]
    return Model(layers, norm(SIZE))


def _by_ops(model: Model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            column: int, int8: bool = False) -> torch.Tensor:  # fmt: skip
    """The step as separate ops, in the stack's order."""
    ops, rows = kernels.ops(), h.shape[0]

    def _product(x: torch.Tensor, w: Weight) -> torch.Tensor:
        return ops.block_linear(x, w.qs, w.d, w.m, w.bias, int8)

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
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
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
    states = kernels.ops().decode_stack(model.stack, mine_h, cos, sin, mine_keys, mine_values,
                                        mask, column, int8)  # fmt: skip
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
    kernels.ops().decode_stack(model.stack, h, cos, sin, keys, values, mask, 5)
    changed = (keys != before).any(dim=(0, 1, 2, 4))
    assert changed.tolist() == [c == 5 for c in range(9)]


def test_bad_arguments_are_refused_naming_them() -> None:
    model = _model(0, "q4_1", head_norms=False)
    ops = kernels.ops()
    h, cos, sin, keys, values, mask = _inputs(2, 5, 9, padded=True, seed=0)
    with pytest.raises(RuntimeError, match=r"h must be \[rows >= 1, 64\]"):
        ops.decode_stack(model.stack, h[:, :32].contiguous(), cos, sin, keys, values, mask, 5)
    with pytest.raises(RuntimeError, match=r"cos must be \[2, 16\]"):
        ops.decode_stack(model.stack, h, cos[:1], sin, keys, values, mask, 5)
    with pytest.raises(RuntimeError, match=r"mask must be \[2, 6\]"):
        ops.decode_stack(model.stack, h, cos, sin, keys, values, mask[:, :5].contiguous(), 5)
    with pytest.raises(RuntimeError, match="column 9 is outside a cache of 9 columns"):
        ops.decode_stack(model.stack, h, cos, sin, keys, values, None, 9)
    with pytest.raises(RuntimeError, match=r"keys must be \[3, 2, 2, room, 16\]"):
        ops.decode_stack(model.stack, h, cos, sin, keys[:2], values[:2], None, 5)
    with pytest.raises(RuntimeError, match="keys and values must have one shape"):
        ops.decode_stack(model.stack, h, cos, sin, keys, values[..., :8, :], None, 5)


def test_bad_weights_are_refused_when_the_stack_is_built() -> None:
    good = _model(0, "q8_0", head_norms=False)
    layer = good.layers[1]
    layer.o = _weight(torch.Generator().manual_seed(1), SIZE, 2 * HEADS * DIM, "q8_0", bias=False)
    with pytest.raises(RuntimeError, match="layer 1 o is 64 x 128, not 64 x 64"):
        Model(good.layers, good.norm)
    layer.o = _weight(torch.Generator().manual_seed(1), SIZE, HEADS * DIM, "q8_0", bias=False)
    layer.norm_in = torch.ones(SIZE + 1)
    with pytest.raises(RuntimeError, match=r"layer 1 norm_in must be \[64\]"):
        Model(good.layers, good.norm)
    with pytest.raises(RuntimeError, match="takes 61 tensors and 13 scalars"):
        torch.classes.omni_kernels.DecodeStack(
            [None], [1.0], [3, HEADS, KV_HEADS, DIM, SIZE, INTER]
        )
