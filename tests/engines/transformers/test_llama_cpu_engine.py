"""The fast CPU runner inside the engine: the shipped default, SmolLM2 on its GGUF
blocks, takes it (its fused q/k/v and gate/up products hold no second copy of the
weights, its decode steps run the stack, and its greedy tokens are the reference
runner's, alone and eight at once, padded); where it does not apply, the engine runs
the model's own forward.

test_runners.py checks the arithmetic on tiny models; this checks the engine's use of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services import kernels
from services.engines.base import EngineRequest, EngineSettings, SamplingParams
from services.engines.scheduler import StepTaken
from services.engines.transformers import TransformersEngine
from services.engines.transformers.loading import model_info
from services.engines.transformers.runners import runner_name
from services.engines.transformers.runners.llama_cpu import LlamaCpuRunner, llama_cpu_refuses
from services.engines.transformers.weights.blocks import BlockLinear
from services.testing.chat_prompts import CHAT_PROMPTS
from services.testing.configs import TINY_LLAMA
from services.testing.engine_runs import generate
from tests.helpers.text_engine import collect

MAX_TOKENS = 16


pytestmark = pytest.mark.skipif(
    kernels.variant() in ("none", "reference"),
    reason=f"the GGUF blocks run by default only on a vector variant of the CPU kernels "
    f"(here: {kernels.describe()})",
)


def blocks_engine(gguf: Path, cache_dir: Path, runner: str) -> TransformersEngine:
    settings = EngineSettings(
        cache_dir=cache_dir,
        max_batch_size=8,
        engine_args={"weights": "gguf_blocks", "runner": runner},
    )
    engine = TransformersEngine(settings)
    engine.load(gguf)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def fast_engine(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[TransformersEngine]:
    engine = blocks_engine(smollm2_gguf, omni_cache_dir, "auto")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def own_engine(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[TransformersEngine]:
    engine = blocks_engine(smollm2_gguf, omni_cache_dir, "reference")
    yield engine
    engine.close()


def greedy(rid: str, prompt: str) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return EngineRequest(rid, messages=(("user", prompt),), params=params)


async def answers(
    engine: TransformersEngine, prompts: tuple[str, ...], together: bool
) -> list[list[int]]:
    requests = [greedy(f"p{i}", p) for i, p in enumerate(prompts)]
    if together:
        runs = await asyncio.gather(*(collect(generate(engine, r)) for r in requests))
    else:
        runs = [await collect(generate(engine, r)) for r in requests]
    return [run.tokens for run in runs]


def test_fused_blocks_are_the_layers_own(fast_engine: TransformersEngine) -> None:
    """fuse() concatenates the q/k/v (and gate/up) blocks once and leaves the layers'
    buffers as views of them: the model holds each weight once, as before."""
    model = fast_engine.model
    runner = fast_engine.runner
    assert isinstance(runner, LlamaCpuRunner)
    lean = runner.lean
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        fused = {"qkv": lean.layers[index].qkv, "gate_up": lean.layers[index].gate_up}
        parts = {
            "qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
            "gate_up": [mlp.gate_proj, mlp.up_proj],
        }
        for name, whole in fused.items():
            assert isinstance(whole, BlockLinear), (index, name)
            for part in parts[name]:
                assert type(part) is BlockLinear
                for buffer in ("qs", "d", "m"):
                    mine, theirs = getattr(part, buffer), getattr(whole, buffer)
                    if theirs is None:
                        assert mine is None
                        continue
                    shared = (
                        mine.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
                    )
                    assert shared, f"layer {index}: {name}'s {buffer} is a copy"
    # Every tensor the model and its lean forward hold, each storage counted once, is
    # what model_info counts: nothing is held twice.
    storages: dict[int, int] = {}
    fused_modules = [m for layer in lean.layers for m in (layer.qkv, layer.gate_up)]
    for tensor in [*model.parameters(), *model.buffers()] + [
        t for m in fused_modules if isinstance(m, BlockLinear) for t in m.buffers()
    ]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    info = model_info(model)
    assert sum(storages.values()) == info.model_bytes
    assert 200 * 2**20 < info.model_bytes < 230 * 2**20  # Q4_1 blocks and float32 embeddings


async def test_greedy_tokens_equal_the_reference_runners(
    fast_engine: TransformersEngine, own_engine: TransformersEngine
) -> None:
    """Four prompts alone, then eight at once: prompts of different lengths decode in
    one batch padded on the left, in the decode stack, with its mask
    (benchmarks/precision_agreement.py: 0 of 32 answers differ)."""
    assert runner_name(own_engine.runner) == "reference"
    alone = CHAT_PROMPTS[:4]
    assert await answers(fast_engine, alone, False) == await answers(own_engine, alone, False)
    runner = fast_engine.runner
    assert isinstance(runner, LlamaCpuRunner)
    taken: list[StepTaken] = []
    stop = fast_engine.scheduler.watch(taken.append)
    stacked = runner.stack_steps
    together = CHAT_PROMPTS[:8]
    try:
        fast_tokens = await answers(fast_engine, together, True)
    finally:
        stop()
    assert max(len(t.decode) for t in taken) == 8, taken  # all eight in one step
    assert runner.stack_steps - stacked == sum(1 for t in taken if t.decode and not t.prefill)
    assert len({len(CHAT_PROMPTS[i]) for i in range(8)}) > 1  # padded: a mask in the stack
    assert fast_tokens == await answers(own_engine, together, True)


def _own_greedy(model: Any, prompt: list[int], count: int) -> list[int]:
    """Greedy tokens from full forwards over the whole sequence (no cache, no batch)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


async def test_where_the_fast_runner_does_not_apply_the_engine_runs_the_models_forward(
    smollm2_gguf: Path, omni_cache_dir: Path
) -> None:
    torch.manual_seed(0)
    settings = EngineSettings(
        load_format="dummy",
        cache_dir=omni_cache_dir,
        engine_args={"config_overrides": {**TINY_LLAMA, "hidden_act": "gelu"}},
    )
    engine = TransformersEngine(settings)
    engine.load(smollm2_gguf)
    try:
        why = llama_cpu_refuses(engine.model)
        assert why is not None and "gelu" in why
        assert runner_name(engine.runner) == "reference"
        calls: list[int] = []
        handle = engine.model.register_forward_pre_hook(lambda *_: calls.append(1))
        prompt = (5, 6, 7, 8, 9)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        run = await collect(
            generate(engine, EngineRequest("gelu", token_ids=prompt, params=params))
        )
        handle.remove()
        assert len(calls) == 8  # a prefill and seven decode steps, each the model's forward
        assert run.tokens == _own_greedy(engine.model, list(prompt), 8)
    finally:
        engine.close()
