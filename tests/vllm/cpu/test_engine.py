"""The vllm engine on vLLM's CPU build, serving SmolLM2-135M: the same greedy
tokens as plain vLLM, token by token, with stop strings, cancellation, prompt
embeddings and concurrent requests. One engine for the module (it starts in
15-50 s on a small machine)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from services.engines.base import EngineEvent, EngineSettings, FinishOutput, TokenOutput
from services.engines.vllm import VllmEngine, cpu
from services.testing.engine_runs import collect, generate, tokens_of
from tests.helpers.polling import eventually
from tests.helpers.reference_answer import ReferenceLM
from tests.helpers.vllm_parts import embeds_request, request
from tests.vllm.cpu.conftest import DTYPE, FRANCE, MAX_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def engine(
    cpu_vllm: None, plain: Any, smollm2_gguf: Path, omni_cache_dir: Path
) -> Iterator[VllmEngine]:
    # `plain` first: its vLLM process has exited before this one starts.
    settings = EngineSettings(
        device="cpu",
        dtype=DTYPE,
        cache_dir=omni_cache_dir,
        max_prompt_tokens=1024,
        engine_args={"max_model_len": 2048, "enforce_eager": True, "enable_prompt_embeds": True},
    )
    engine = VllmEngine(settings)
    info = engine.load(smollm2_gguf)  # the GGUF itself: the engine converts it
    pages, page_size = engine.kv_cache()
    # The 1 GiB default KV cache, as vLLM allocated it (not host RAM).
    assert info.kv is not None
    per_token = 2 * info.kv.layers * info.kv.kv_heads * info.kv.head_dim * info.kv.dtype_bytes
    assert pages * page_size * per_token == pytest.approx(1 << 30, rel=0.1)
    yield engine
    engine.close()


def text_of(events: list[EngineEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenOutput))


def finish(events: list[EngineEvent]) -> FinishOutput:
    last = events[-1]
    assert isinstance(last, FinishOutput), events
    return last


def test_converted_smollm2_answers_in_plain_vllm(
    plain: dict[str, Any], prompt_ids: list[list[int]], smollm2_reference: ReferenceLM
) -> None:
    """The converted folder loads in plain vLLM as the model it is: in float32, vLLM's
    answers are transformers' float32 answers on this machine, up to a near-tie."""
    for i, ids in enumerate(plain["token_ids"][: len(PROMPTS)]):
        assert len(ids) > 0 and set(ids) != {0}  # a folder vLLM misreads says token 0
        if DTYPE == "float32":
            smollm2_reference.continuation(prompt_ids[i], MAX_TOKENS).assert_said(ids)


async def test_greedy_ids_equal_plain_vllms(
    engine: VllmEngine, plain: dict[str, Any], prompt_ids: list[list[int]]
) -> None:
    ours = [
        tokens_of(
            await collect(
                generate(
                    engine,
                    request(
                        text=None, token_ids=tuple(ids), max_tokens=MAX_TOKENS, temperature=0.0
                    ),
                )
            )
        )
        for ids in prompt_ids
    ]
    assert ours == plain["token_ids"][: len(PROMPTS)]


async def test_tokens_stream_one_by_one(engine: VllmEngine, plain: dict[str, Any]) -> None:
    events = await collect(generate(engine, request(text=FRANCE, max_tokens=8, temperature=0.0)))
    tokens = [e for e in events if isinstance(e, TokenOutput)]
    assert [len(t.token_ids) for t in tokens] == [1] * 8
    assert tokens_of(events) == plain["token_ids"][PROMPTS.index(FRANCE)][:8]
    assert finish(events).reason == "length" and finish(events).completion_tokens == 8


async def test_a_stop_string_ends_the_text_before_it(engine: VllmEngine) -> None:
    full = text_of(
        await collect(
            generate(engine, request(text=FRANCE, max_tokens=MAX_TOKENS, temperature=0.0))
        )
    )
    # A word of what vLLM says on this machine, past its first.
    stop = next(w for w in full.split()[1:] if w.isalpha())
    events = await collect(
        generate(engine, request(text=FRANCE, max_tokens=MAX_TOKENS, temperature=0.0, stop=(stop,)))
    )
    assert finish(events).reason == "stop"
    assert text_of(events) == full[: full.index(stop)]


async def test_closing_the_stream_cancels_the_request(engine: VllmEngine) -> None:
    stream = generate(engine, request(text=FRANCE, max_tokens=1000, temperature=0.0))
    got = [await anext(stream), await anext(stream)]
    assert all(isinstance(e, TokenOutput) for e in got)
    await stream.aclose()
    llm = engine._llm
    # vLLM aborts it on its next step.
    await eventually(lambda: llm.get_num_unfinished_requests() == 0, 5, message="not aborted")
    after = await collect(generate(engine, request(text=FRANCE, max_tokens=4, temperature=0.0)))
    assert finish(after).completion_tokens == 4


async def test_prompt_embeddings_give_the_token_prompts_answer(
    engine: VllmEngine, smollm2_folder: Path, prompt_ids: list[list[int]]
) -> None:
    with safe_open(smollm2_folder / "model.safetensors", "pt") as weights:
        table = weights.get_tensor("model.embed_tokens.weight")
    ids = prompt_ids[0]
    embeds = table[torch.tensor(ids)].to(torch.bfloat16)
    by_embeds = await collect(
        generate(engine, embeds_request(embeds, max_tokens=8, temperature=0.0))
    )
    by_ids = await collect(
        generate(engine, request(text=None, token_ids=tuple(ids), max_tokens=8, temperature=0.0))
    )
    assert tokens_of(by_embeds) == tokens_of(by_ids) and len(tokens_of(by_ids)) == 8


async def test_concurrent_requests_run_together(engine: VllmEngine) -> None:
    n = 8
    before = len(engine.steps.running)
    results = await asyncio.wait_for(
        asyncio.gather(
            *(
                collect(generate(engine, request(text=PROMPTS[i % len(PROMPTS)],
                                                 max_tokens=MAX_TOKENS, temperature=0.0)))
                for i in range(n)
            )
        ),
        300,
    )  # fmt: skip
    # Each ran to its length or its end of text (the haiku ends early).
    assert {finish(r).reason for r in results} <= {"length", "eos"}
    assert all(finish(r).completion_tokens == len(tokens_of(r)) > 0 for r in results)
    # Batched, not queued, as vLLM's scheduler ran them (its own count of running
    # requests, per step): at least every request that ran its whole length in one step
    # together. One that met its end of text in its first tokens may be gone before the
    # last arrivals join (seen with vLLM's AVX2 kernels, whose bfloat16 answers differ:
    # 6 of 8 at most); one after another would show one a step.
    during = list(engine.steps.running)[before:]
    whole = sum(finish(r).completion_tokens == MAX_TOKENS for r in results)
    assert whole >= n // 2, [finish(r) for r in results]
    assert during and max(during) >= whole, during
    # The same prompt, the same greedy answer, whichever batch it ran in.
    for i in range(len(PROMPTS), n):
        assert tokens_of(results[i]) == tokens_of(results[i - len(PROMPTS)])


def test_the_engine_reports_the_kernels_vllm_loaded(engine: VllmEngine) -> None:
    """What the engine says vLLM runs is what this process mapped, named without
    importing any build by name (cpu.py)."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # what vLLM does at start; a no-op if done
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/vllm/_C" in line}
    assert mapped == {cpu.kernels().split()[0] + ".abi3.so"}, mapped
    assert cpu.refuses() is None
