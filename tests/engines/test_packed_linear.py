"""The transformers engine's oneDNN-packed linear weights: on by default on CPU in
float32, the same model (logits and greedy tokens) as the plain one, and off where
asked or where they do not apply."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services.engines.base import EngineRequest, EngineSettings, SamplingParams, TokenOutput
from services.engines.transformers import TransformersEngine
from services.engines.transformers.packed_linear import PackedLinear, pack_linears
from services.mesh.errors import InitFailed
from tests.helpers.stage import TINY_LLAMA

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Why is the sky blue?"]


def _engine(gguf: Path, cache: Path, **engine_args: object) -> TransformersEngine:
    engine = TransformersEngine(
        EngineSettings(cache_dir=cache, max_batch_size=4, engine_args=engine_args)
    )
    engine.load(gguf)
    return engine


@pytest.fixture(scope="module")
def both(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[tuple[TransformersEngine, ...]]:
    packed = _engine(smollm2_gguf, omni_cache_dir)
    plain = _engine(smollm2_gguf, omni_cache_dir, packed_weights=False)
    yield packed, plain
    packed.close()
    plain.close()


def _kinds(model: torch.nn.Module) -> tuple[int, int]:
    modules = list(model.modules())
    return (
        sum(type(m) is torch.nn.Linear for m in modules),
        sum(isinstance(m, PackedLinear) for m in modules),
    )


def test_every_linear_is_packed_by_default_and_none_when_asked_not_to(
    both: tuple[TransformersEngine, TransformersEngine],
) -> None:
    packed, plain = both
    # SmolLM2-135M: 30 layers x (q, k, v, o, gate, up, down) and the output projection.
    assert _kinds(packed.model) == (0, 30 * 7 + 1)
    assert _kinds(plain.model) == (30 * 7 + 1, 0)


@torch.inference_mode()
def test_packed_logits_match_the_plain_model_for_one_row_and_a_batch(
    both: tuple[TransformersEngine, TransformersEngine],
) -> None:
    packed, plain = both
    ids = torch.randint(100, 40_000, (4, 24), generator=torch.Generator().manual_seed(0))
    for rows in (ids[:1], ids):
        mine = packed.model(input_ids=rows).logits
        reference = plain.model(input_ids=rows).logits
        assert mine.shape == reference.shape == (len(rows), 24, 49152)
        # The same sums, blocked differently: float32 rounding apart, no more.
        assert torch.allclose(mine, reference, rtol=1e-4, atol=1e-3)


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
        async for event in engine.generate(request):
            if isinstance(event, TokenOutput):
                out.extend(event.token_ids)
        return out

    packed, plain = both
    for prompt in PROMPTS:
        expected = await tokens(plain, prompt)
        assert len(expected) >= 5
        assert await tokens(packed, prompt) == expected


def test_a_non_boolean_packed_weights_is_refused(omni_cache_dir: Path) -> None:
    with pytest.raises(InitFailed, match=r"engine_args\.packed_weights: expected true or false"):
        TransformersEngine(
            EngineSettings(cache_dir=omni_cache_dir, engine_args={"packed_weights": "yes"})
        )


@torch.inference_mode()
def test_packing_leaves_a_bfloat16_model_alone_and_keeps_a_float32_one_exact() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, **TINY_LLAMA)
    half = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert pack_linears(half) == 0
    assert _kinds(half) == (2 * 7 + 1, 0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.arange(12)[None]
    before = model(input_ids=ids).logits
    assert pack_linears(model) == 2 * 7 + 1
    assert torch.allclose(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
