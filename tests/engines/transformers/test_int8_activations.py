"""``engine_args.activations: int8``: SmolLM2's GGUF-block products on activations
rounded to 8 bits, in the decode stack and in the lean forward alike. The stage says so
in ``compute``; every block linear (the fused ones included) and the stack run it; a
row's answer is its own whatever the batch; the setting is typed and refused by name
where it cannot apply."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services import kernels
from services.engines.base import EngineSettings
from services.engines.kv_cache import KvCache, KvShape
from services.engines.transformers import TransformersEngine
from services.engines.transformers.runners.llama_cpu import LlamaCpuRunner, _weight
from services.engines.transformers.weights.blocks import BlockLinear
from services.mesh.errors import InitFailed

pytestmark = pytest.mark.skipif(
    kernels.variant() in ("none", "reference"),
    reason=f"the GGUF blocks run by default only on a vector variant of the CPU kernels "
    f"(here: {kernels.describe()})",
)


def int8_engine(gguf: Path, cache_dir: Path, activations: str) -> TransformersEngine:
    settings = EngineSettings(
        cache_dir=cache_dir,
        max_batch_size=8,
        engine_args={"weights": "gguf_blocks", "activations": activations},
    )
    engine = TransformersEngine(settings)
    engine.load(gguf)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def engines(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[list[TransformersEngine]]:
    made = [int8_engine(smollm2_gguf, omni_cache_dir, a) for a in ("int8", "float32")]
    yield made
    for engine in made:
        engine.close()


@torch.inference_mode()
def _greedy(runner: LlamaCpuRunner, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Each step's logits [steps][rows][vocab]: a prefill, then decode steps."""
    model = runner.model
    embed = model.get_input_embeddings()
    kv = KvCache(KvShape.of(model.config, model.dtype, model.device), ids.shape[0])
    one = torch.ones(ids.shape[0], 1, dtype=torch.long)
    logits, _ = runner.forward(kv, embed(ids), torch.ones_like(ids), False)
    every = [logits]
    for _ in range(steps):
        logits, _ = runner.forward(kv, embed(logits.argmax(-1)[:, None]), one, False)
        every.append(logits)
    return torch.stack(every)


def test_int8_runs_everywhere_and_a_row_is_the_same_in_any_batch(
    engines: list[TransformersEngine],
) -> None:
    """Every block linear (the fused ones too) and the decode stack take 8-bit
    activations; a row's logits are bit for bit its own alone, whatever the batch (the
    rounding is per row, the products per row). Against the reference runner no
    equality is asked: a rounding to 8 bits turns a last-bit difference of attention
    (sdpa against the kernels') into a step of the activations, the discontinuity
    the kernels' tests bound product by product (tests/kernels/test_q8.py)."""
    fast, floats = engines
    runner = fast.runner
    assert isinstance(runner, LlamaCpuRunner) and runner.int8
    blocks = [m for m in fast.model.modules() if isinstance(m, BlockLinear)]
    blocks += [m for layer in runner.lean.layers for m in (layer.qkv, layer.gate_up)]
    assert blocks and all(isinstance(m, BlockLinear) and m.int8 for m in blocks)
    ids = torch.randint(100, 40000, (8, 12), generator=torch.Generator().manual_seed(0))
    stacked = runner.stack_steps
    together = _greedy(runner, ids, 6)
    assert runner.stack_steps - stacked == 6
    for row in (0, 5):
        assert torch.equal(_greedy(runner, ids[row : row + 1], 6)[:, 0], together[:, row])
    float_runner = floats.runner
    assert isinstance(float_runner, LlamaCpuRunner) and not float_runner.int8
    assert not torch.equal(_greedy(float_runner, ids[:1], 1), together[:2, :1])


def test_compute_names_the_activations(smollm2_gguf: Path, omni_cache_dir: Path) -> None:
    for activations in ("int8", "float32"):
        engine = TransformersEngine(
            EngineSettings(cache_dir=omni_cache_dir, engine_args={"activations": activations})
        )
        try:
            info = engine.load(smollm2_gguf)
        finally:
            engine.close()
        assert f"kernels {kernels.variant()}" in info.compute
        assert f"{activations} activations" in info.compute


@pytest.mark.parametrize(
    ("engine_args", "message", "field"),
    [
        ({"activations": "int4"}, "float32", "engine_args.activations"),
        (
            {"activations": "int8", "weights": "packed"},
            "activations: int8 runs on GGUF blocks only, not with weights: packed",
            "engine_args",
        ),
    ],
)
def test_bad_activations_are_refused_naming_the_field(
    omni_cache_dir: Path, engine_args: dict[str, str], message: str, field: str
) -> None:
    with pytest.raises(InitFailed, match=message) as caught:
        TransformersEngine(EngineSettings(cache_dir=omni_cache_dir, engine_args=engine_args))
    assert caught.value.field == field


@pytest.mark.parametrize("precision", ["int8", "float32"])
@torch.inference_mode()
def test_a_prefill_is_its_prompt_stepped_token_by_token(
    engines: list[TransformersEngine], precision: str
) -> None:
    """A prompt without padding prefills through the decode stack, row by row: the
    logits after it are bit for bit those of the prompt's first two tokens prefilled
    and the rest fed one decode step at a time, for each row of a batch."""
    runner = engines[0 if precision == "int8" else 1].runner
    assert isinstance(runner, LlamaCpuRunner) and runner.int8 == (precision == "int8")
    model = runner.model
    embed = model.get_input_embeddings()
    ids = torch.randint(100, 40000, (3, 11), generator=torch.Generator().manual_seed(1))

    def cache() -> KvCache:
        return KvCache(KvShape.of(model.config, model.dtype, model.device), 3)

    prefills = runner.stack_prefills
    whole, _ = runner.forward(cache(), embed(ids), torch.ones_like(ids), False)
    assert runner.stack_prefills == prefills + 1
    kv = cache()
    logits, _ = runner.forward(kv, embed(ids[:, :2]), torch.ones_like(ids[:, :2]), False)
    for column in range(2, ids.shape[1]):
        one = ids[:, column : column + 1]
        logits, _ = runner.forward(kv, embed(one), torch.ones_like(one), False)
    assert torch.equal(whole, logits)


@pytest.mark.parametrize("precision", ["int8", "float32"])
@torch.inference_mode()
def test_a_row_prefilled_in_a_padded_batch_is_the_row_alone(
    engines: list[TransformersEngine], precision: str
) -> None:
    """Prompts of different lengths prefill together, padded on the left: each row's
    logits, and the decode steps after, are bit for bit the row's own alone."""
    runner = engines[0 if precision == "int8" else 1].runner
    assert isinstance(runner, LlamaCpuRunner)
    model = runner.model
    embed = model.get_input_embeddings()
    g = torch.Generator().manual_seed(2)
    lengths = (9, 4, 13)
    prompts = [torch.randint(100, 40000, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    valid = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, -len(prompt) :], valid[row, -len(prompt) :] = prompt, 1

    def run(rows: torch.Tensor, seen: torch.Tensor) -> list[torch.Tensor]:
        kv = KvCache(KvShape.of(model.config, model.dtype, model.device), rows.shape[0])
        one = torch.ones(rows.shape[0], 1, dtype=torch.long)
        logits, _ = runner.forward(kv, embed(rows), seen, False)
        every = [logits]
        for _ in range(3):
            logits, _ = runner.forward(kv, embed(logits.argmax(-1)[:, None]), one, False)
            every.append(logits)
        return every

    prefills = runner.stack_prefills
    together = run(ids, valid)
    assert runner.stack_prefills == prefills + 1
    for row, prompt in enumerate(prompts):
        alone = run(prompt[None], torch.ones(1, len(prompt), dtype=torch.long))
        for step, (mine, theirs) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(mine[row], theirs[0]), (row, step)


@torch.inference_mode()
def test_on_int8_every_weight_runs_packed_and_on_float32_none_is_held(
    engines: list[TransformersEngine],
) -> None:
    """The runner's products (its layers' four, the output head) and its decode stack
    run the packed layout on 8-bit activations: a product through the module is the
    kernels' over its packed weight, bit for bit, and not the file layout's (the two
    add in another order); the stack is built from the same packed tensors. On float32
    activations nothing is packed (no second copy held)."""
    fast, floats = engines
    runner = fast.runner
    assert isinstance(runner, LlamaCpuRunner)
    ops = kernels.ops()
    lean = runner.lean
    modules = [
        m for layer in lean.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    modules.append(lean.lm_head)
    assert all(isinstance(m, BlockLinear) and m.packed is not None for m in modules)
    differs = 0
    for module in (lean.layers[0].qkv, lean.layers[3].down, lean.lm_head):
        assert isinstance(module, BlockLinear) and module.packed is not None
        x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(1))
        got = module(x)
        args = (x, module.qs, module.d, module.m, module.bias, True)
        assert torch.equal(got, ops.block_linear(*args, module.packed))
        differs += not torch.equal(got, ops.block_linear(*args))
    assert differs, "the packed products add as the file layout's did: is packed used?"
    assert _weight(lean.layers[2].gate_up).packed is lean.layers[2].gate_up.packed
    float_blocks = [m for m in floats.model.modules() if isinstance(m, BlockLinear)]
    assert float_blocks and all(m.packed is None and m._packed is None for m in float_blocks)
