"""A decode step's whole layer stack in one C call (decode_stack.py) computes exactly
what the lean forward's C glue path computes: the same C functions in the same order,
so logits and states are equal bit for bit, not merely close. The glue path itself is
checked against float64 (test_fused_ops.py, test_lean_forward.py); the real SmolLM2's
greedy tokens against its own forward (test_lean_engine.py).

Tiny random decoders get their linears replaced by random GGUF blocks (Q4_1 for the
attention, Q8_0 for the MLP, so both kinds run in one stack), Qwen2's q/k/v biases
included. The batch joins and drops rows between steps and runs long enough for the
cache buffers to grow, so the stack is re-pointed at new buffers mid-run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from services.engines.base import EngineSettings
from services.engines.transformers import TransformersEngine, block_linear, decode_stack
from services.engines.transformers.block_linear import QK, BlockLinear, Blocks
from services.engines.transformers.decode_stack import DecodeStack
from services.engines.transformers.kv_rows import KvRows
from services.engines.transformers.lean_forward import lean_of
from tests.engines.transformers.test_lean_forward import padded, tiny

pytestmark = pytest.mark.skipif(
    decode_stack.unavailable() is not None,
    reason=f"decode stack unavailable: {decode_stack.unavailable()} (pip install -e .)",
)

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def random_blocks(kind: str, n: int, k: int, generator: torch.Generator) -> Blocks:
    blocks = k // QK
    if kind == "q4_1":
        qs = torch.randint(0, 256, (n, blocks, QK // 2), dtype=torch.uint8, generator=generator)
        m: torch.Tensor | None = -0.1 * torch.rand(n, blocks, generator=generator)
    else:
        qs = torch.randint(-128, 128, (n, blocks, QK), dtype=torch.int8, generator=generator)
        m = None
    scale = 0.02 if kind == "q4_1" else 0.002
    return Blocks(kind, qs, scale * torch.rand(n, blocks, generator=generator), m)


def on_blocks(name: str) -> PreTrainedModel:
    """A tiny model of ``name`` whose projections are random GGUF blocks (attention's
    Q4_1, the MLP's Q8_0), biases kept."""
    model = tiny(name)
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for child, linear in list(parent.named_children()):
                if child not in PROJECTIONS:
                    continue
                assert isinstance(linear, nn.Linear)
                kind = "q4_1" if parent is layer.self_attn else "q8_0"
                blocks = random_blocks(kind, linear.out_features, linear.in_features, generator)
                bias = None if linear.bias is None else linear.bias.detach().clone()
                setattr(parent, child, BlockLinear(blocks, bias))
    return model


class Steps:
    """Each step's logits and states, and how many decode steps the stack ran."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []
        self.stacked = 0


PROMPTS = [[5, 17, 99, 3, 64, 12, 7], [41, 8, 120, 33], [77]]  # left-padded to 7
JOINING = [[9, 30, 2]]
DECODE_STEPS = 24  # past the buffers' first room (7 + 16 columns): they grow mid-run


@torch.inference_mode()
def run(model: PreTrainedModel, stack: bool, monkeypatch: pytest.MonkeyPatch) -> Steps:
    """A padded batch prefilled, then fed fixed random tokens (a random model's greedy
    choices soon repeat one token); after 6 steps a prompt joins, after 12 the second
    row leaves. ``stack``: with the stack, else the glue path."""
    lean = lean_of(model)
    assert lean is not None and lean.fused
    built = lean.stack
    assert built is not None, lean.stack_declined
    lean.stack = built if stack else None
    steps = Steps()
    real = DecodeStack.__call__

    def counted(self: DecodeStack, *args: object) -> torch.Tensor:
        steps.stacked += 1
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    embed = model.get_input_embeddings()
    kv = KvRows(model)
    kv.add_rows(len(PROMPTS))
    ids, valid = padded(PROMPTS)
    kv.forward(embed(ids), valid, True)
    fed = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 128, (len(PROMPTS),), generator=fed)
    try:
        for step in range(DECODE_STEPS):
            if step == 6:
                joining = KvRows(model)
                joining.add_rows(1)
                ids, valid = padded(JOINING)
                joining.forward(embed(ids), valid, True)
                kv.concat(joining)
                tokens = torch.cat([tokens, torch.randint(1, 128, (1,), generator=fed)])
            if step == 12:
                kv.select([0, 2, 3])
                tokens = tokens[[0, 2, 3]]
            ones = torch.ones(len(tokens), 1, dtype=torch.long)
            logits, states = kv.forward(embed(tokens[:, None]), ones, True)
            assert states is not None
            steps.logits.append(logits)
            steps.states.append(states)
            tokens = torch.randint(1, 128, (len(tokens),), generator=fed)
    finally:
        lean.stack = built
    return steps


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_the_stack_equals_the_glue_path_bit_for_bit(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = on_blocks(name)
    mine = run(model, True, monkeypatch)
    glue = run(model, False, monkeypatch)
    assert mine.stacked == DECODE_STEPS  # every decode step went through the stack
    assert glue.stacked == 0
    for step, (a, b) in enumerate(zip(mine.logits, glue.logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at decode step {step}"
    for step, (a, b) in enumerate(zip(mine.states, glue.states, strict=True)):
        assert torch.equal(a, b), f"states differ at decode step {step}"
    # the rows' answers differ from each other and from step to step
    assert len(torch.cat(mine.logits).argmax(-1).unique()) > 10


def test_where_the_stack_cannot_run_it_says_why() -> None:
    plain = lean_of(tiny("llama"))  # float32 linears
    assert plain is not None and plain.stack is None
    assert plain.stack_declined == "q, k and v is not one product on GGUF blocks"
    qwen3 = lean_of(on_blocks("qwen3"))
    assert qwen3 is not None and qwen3.stack is None
    assert qwen3.stack_declined == "its attention normalises q and k per head"


@pytest.fixture(scope="module")
def stack() -> Iterator[DecodeStack]:
    lean = lean_of(on_blocks("llama"))
    assert lean is not None and lean.stack is not None
    yield lean.stack


def _arguments(stack: DecodeStack, rows: int = 2, room: int = 4) -> dict[str, object]:
    keys = torch.zeros(rows, stack.kv_heads, room, stack.dim)
    return {
        "h": torch.randn(rows, stack.size),
        "cos": torch.ones(rows, stack.dim),
        "sin": torch.zeros(rows, stack.dim),
        "caches": [(keys.clone(), keys.clone()) for _ in range(2)],
        "mask": None,
        "column": 1,
    }


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"h": torch.randn(2, 63)}, "h must be contiguous torch.float32 [2, 64]"),
        ({"h": torch.randn(64, 2).t()}, "h must be contiguous"),
        ({"cos": torch.ones(2, 16, dtype=torch.float64)}, "cos must be contiguous torch.float32"),
        ({"mask": torch.ones(2, 2)}, "mask must be contiguous torch.uint8 [2, 2]"),
        ({"mask": torch.ones(2, 3, dtype=torch.uint8)}, "mask must be contiguous torch.uint8"),
        ({"column": 4}, "a cache of 4 columns has no column 4"),
        ({"caches": []}, "0 caches for 2 layers"),
        ({"h": torch.randn(0, 64), "cos": torch.ones(0, 16)}, "1 to 127 rows, not 0"),
    ],
)
def test_bad_arguments_are_refused_naming_them(
    stack: DecodeStack, change: dict[str, object], named: str
) -> None:
    arguments = _arguments(stack) | change
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        stack(**arguments)  # type: ignore[arg-type]


def test_caches_of_another_shape_are_refused(stack: DecodeStack) -> None:
    arguments = _arguments(stack)
    keys = torch.zeros(2, stack.kv_heads + 1, 4, stack.dim)
    arguments["caches"] = [(keys, keys.clone())] * 2
    with pytest.raises(ValueError, match=r"keys must be contiguous torch\.float32"):
        stack(**arguments)  # type: ignore[arg-type]
    values = torch.zeros(2, stack.kv_heads, 5, stack.dim)
    arguments["caches"] = [(torch.zeros(2, stack.kv_heads, 4, stack.dim), values)] * 2
    with pytest.raises(ValueError, match="keys and values must be buffers of one layout"):
        stack(**arguments)  # type: ignore[arg-type]


def test_a_step_writes_its_column_and_leaves_the_others(stack: DecodeStack) -> None:
    """The new keys and values go to column ``column`` of every row and layer; the
    columns after it are untouched (the buffers' room)."""
    arguments = _arguments(stack, rows=3, room=6)
    for keys, values in arguments["caches"]:  # type: ignore[attr-defined]
        keys.fill_(7.0)
        values.fill_(7.0)
    stack(**arguments | {"column": 2})  # type: ignore[arg-type]
    for keys, values in arguments["caches"]:  # type: ignore[attr-defined]
        for buffer in (keys, values):
            assert bool((buffer[:, :, 2] != 7.0).all())
            assert bool((buffer[:, :, [0, 1, 3, 4, 5]] == 7.0).all())


@pytest.fixture(scope="module")
def smollm2_engine_model(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[PreTrainedModel]:
    engine = TransformersEngine(EngineSettings(cache_dir=omni_cache_dir, max_batch_size=8))
    engine.load(smollm2_gguf)
    yield engine.model
    engine.close()


def test_smollm2_on_its_gguf_blocks_decodes_through_the_stack(
    smollm2_engine_model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped default: the engine's SmolLM2 takes the stack (not silently the
    glue path), and its steps equal the glue path's bit for bit."""
    if block_linear.simd() != "avx512":  # loading.py: auto keeps float32 weights then
        pytest.skip(f"the engine runs GGUF blocks only on the AVX-512 path ({block_linear.simd()})")
    lean = lean_of(smollm2_engine_model)
    assert lean is not None and lean.stack is not None, lean and lean.stack_declined
    embed = smollm2_engine_model.get_input_embeddings()
    outs = []
    for with_stack in (True, False):
        built = lean.stack
        lean.stack = built if with_stack else None
        try:
            with torch.inference_mode():
                kv = KvRows(smollm2_engine_model)
                kv.add_rows(2)
                ids, valid = padded([[1, 9690, 198, 28120, 30], [1, 4093, 30]])
                logits, _ = kv.forward(embed(ids), valid, False)
                steps = []
                for _ in range(4):
                    token = logits.argmax(-1)
                    logits, _ = kv.forward(
                        embed(token[:, None]), torch.ones(2, 1, dtype=torch.long), False
                    )
                    steps.append(logits)
        finally:
            lean.stack = built
        outs.append(torch.stack(steps))
    assert torch.equal(outs[0], outs[1])
