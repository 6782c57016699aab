"""The transformers engine's oneDNN-packed linear weights (``engine_args.weights:
packed``, what ``auto`` runs on CPU in float32 where no GGUF blocks apply): the same
model (logits and greedy tokens) as the plain one, and off where asked or where they
do not apply."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services.engines.base import EngineRequest, EngineSettings, SamplingParams, TokenOutput
from services.engines.transformers import TransformersEngine
from services.engines.transformers.weights.packed import PackedLinear, pack_linears
from services.testing.configs import TINY_LLAMA
from services.testing.engine_runs import generate
from tests.helpers.float_error import assert_float32_close, assert_same_choices, row_errors

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Why is the sky blue?"]


def _engine(gguf: Path, cache: Path, **engine_args: object) -> TransformersEngine:
    engine = TransformersEngine(
        EngineSettings(cache_dir=cache, max_batch_size=4, engine_args=engine_args)
    )
    engine.load(gguf)
    return engine


@pytest.fixture(scope="module")
def both(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[tuple[TransformersEngine, ...]]:
    packed = _engine(smollm2_gguf, omni_cache_dir, weights="packed")
    plain = _engine(smollm2_gguf, omni_cache_dir, weights="plain")
    yield packed, plain
    packed.close()
    plain.close()


@pytest.fixture(scope="module")
def exact(both: tuple[TransformersEngine, TransformersEngine]) -> torch.nn.Module:
    """The plain model in float64: what both float32 paths are measured against."""
    return copy.deepcopy(both[1].model).double()


def _kinds(model: torch.nn.Module) -> tuple[int, int]:
    modules = list(model.modules())
    return (
        sum(type(m) is torch.nn.Linear for m in modules),
        sum(isinstance(m, PackedLinear) for m in modules),
    )


def test_every_linear_is_packed_when_asked_and_none_when_plain(
    both: tuple[TransformersEngine, TransformersEngine],
) -> None:
    packed, plain = both
    # SmolLM2-135M: 30 layers x (q, k, v, o, gate, up, down) and the output projection.
    assert _kinds(packed.model) == (0, 30 * 7 + 1)
    assert _kinds(plain.model) == (30 * 7 + 1, 0)


@torch.inference_mode()
def test_packed_logits_match_the_plain_model_for_one_row_and_a_batch(
    both: tuple[TransformersEngine, TransformersEngine], exact: torch.nn.Module
) -> None:
    packed, plain = both
    ids = torch.randint(100, 40_000, (4, 24), generator=torch.Generator().manual_seed(0))
    for rows in (ids[:1], ids):
        mine = packed.model(input_ids=rows).logits
        trusted = plain.model(input_ids=rows).logits
        reference = exact(input_ids=rows).logits
        assert mine.shape == trusted.shape == (len(rows), 24, 49152)
        # The same sums, blocked differently: float32 rounding apart, no more.
        assert_float32_close(mine, trusted, reference)
        assert_same_choices(mine, trusted, reference)


async def test_packed_greedy_tokens_equal_the_plain_model(
    both: tuple[TransformersEngine, TransformersEngine],
) -> None:
    async def tokens(engine: TransformersEngine, prompt: str) -> list[int]:
        request = EngineRequest(
            prompt,
            messages=(("user", prompt),),
            params=SamplingParams(max_tokens=10, temperature=0.0),
        )
        out: list[int] = []
        async for event in generate(engine, request):
            if isinstance(event, TokenOutput):
                out.extend(event.token_ids)
        return out

    packed, plain = both
    for prompt in PROMPTS:
        expected = await tokens(plain, prompt)
        assert len(expected) >= 5
        assert await tokens(packed, prompt) == expected


def _tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, **TINY_LLAMA)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@torch.inference_mode()
def test_packing_leaves_a_float16_model_alone_and_a_float32_one_the_same_model() -> None:
    half = _tiny_llama(torch.float16)
    assert pack_linears(half) == 0
    assert _kinds(half) == (2 * 7 + 1, 0)
    model = _tiny_llama(torch.float32)
    exact = copy.deepcopy(model).double()
    ids = torch.arange(12)[None]
    before = model(input_ids=ids).logits
    assert pack_linears(model) == 2 * 7 + 1
    assert_float32_close(model(input_ids=ids).logits, before, exact(input_ids=ids).logits)


@torch.inference_mode()
def test_a_wrong_packed_weight_fails_the_same_criterion() -> None:
    """The tolerance is no blanket: one weight of fifteen off by 1e-2, or transposed,
    is caught."""
    plain = _tiny_llama(torch.float32)
    exact = copy.deepcopy(plain).double()
    ids = torch.arange(12)[None]
    trusted, reference = plain(input_ids=ids).logits, exact(input_ids=ids).logits
    noise = torch.Generator().manual_seed(1)
    wrongs = {
        "model.layers.1.mlp.down_proj": lambda w: w + 1e-2 * torch.randn(w.shape, generator=noise),
        "model.layers.0.self_attn.q_proj": lambda w: w.T,  # 64 x 64: the shape allows it
    }
    for path, wrong in wrongs.items():
        model = copy.deepcopy(plain)
        linear = model.get_submodule(path)
        assert isinstance(linear, torch.nn.Linear)
        linear.weight.copy_(wrong(linear.weight).clone())
        assert pack_linears(model) == 2 * 7 + 1
        assert not row_errors(model(input_ids=ids).logits, trusted, reference).ok, path
