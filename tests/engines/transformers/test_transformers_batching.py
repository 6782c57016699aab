"""Continuous batching in the transformers engine: requests share forward passes,
join and leave a running batch, and get the same tokens as alone.

Every forward the scheduler runs is watched (the requests in it and their columns),
so the tests see the batches themselves, not only the answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import BatchEncoding

from services.engines.base import (
    EngineRequest,
    EngineSettings,
    SamplingParams,
    TokenOutput,
)
from services.engines.scheduler import StepTaken
from services.engines.transformers import TransformersEngine
from services.mesh.errors import InvalidArgument
from services.testing.configs import TINY_LLAMA
from services.testing.engine_runs import generate
from tests.helpers.float_error import assert_float32_close
from tests.helpers.text_engine import Result, collect

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Name a prime number above ten.",
    "How do bees make honey?",
    "Explain what a CPU cache is.",
    "Describe a red apple.",
]


def chat(rid: str, prompt: str, max_tokens: int = 12, **params: Any) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return EngineRequest(rid, messages=(("user", prompt),), params=sampling)


class Forwards:
    """(rows, columns) of every forward the engine's scheduler runs, in order (a
    prefill: its rows, by the chunk's columns; a decode step: its rows, by one), and
    how many were mixed steps (prefill and decode rows in one forward)."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.taken: list[StepTaken] = []
        self._stop = engine.scheduler.watch(self.taken.append)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        shapes = []
        for t in self.taken:
            if t.prefill:
                shapes.append((len(t.prefill), t.chunk))
            if t.decode:
                shapes.append((len(t.decode), 1))
        return shapes

    @property
    def mixed(self) -> int:
        return sum(t.mixed for t in self.taken)

    @property
    def decode_rows(self) -> list[int]:
        return [len(t.decode) for t in self.taken if t.decode]

    def clear(self) -> None:
        self.taken.clear()

    def close(self) -> None:
        self._stop()


@pytest.fixture(scope="module")
def engine(smollm2_engine: TransformersEngine) -> TransformersEngine:
    assert len(PROMPTS) <= smollm2_engine._settings.max_batch_size  # all in one batch
    return smollm2_engine


@pytest.fixture(scope="module")
def exact(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[torch.nn.Module]:
    """The same model in float64 with plain linears: the reference for hidden states."""
    plain = TransformersEngine(
        EngineSettings(cache_dir=omni_cache_dir, engine_args={"weights": "plain"})
    )
    plain.load(smollm2_gguf)
    yield plain.model.double()
    plain.close()


@pytest.fixture
def forwards(engine: TransformersEngine) -> Iterator[Forwards]:
    recorder = Forwards(engine)
    yield recorder
    recorder.close()


async def alone(engine: TransformersEngine, request: EngineRequest) -> Result:
    return await collect(generate(engine, request))


async def test_concurrent_requests_share_each_step_and_match_their_solo_tokens(
    engine: TransformersEngine, forwards: Forwards
) -> None:
    requests = [chat(f"r{i}", p, max_tokens=6) for i, p in enumerate(PROMPTS)]
    solo = [await alone(engine, r) for r in requests]
    forwards.clear()
    together = await asyncio.gather(*(collect(generate(engine, r)) for r in requests))
    # Greedy: the same tokens in a batch as alone (measured over 32 prompts by
    # benchmarks/stage_batching.py; padding and batch-size-dependent fp32 sums could
    # flip a near-tie, which these prompts do not have).
    assert [r.tokens for r in together] == [r.tokens for r in solo]
    assert max(forwards.decode_rows) == len(PROMPTS)  # every request in one decode step
    steps = sum(len(r.tokens) for r in together)
    assert len(forwards.taken) < steps / 3  # shared forwards, not one per token


async def test_requests_join_and_leave_a_running_batch(
    engine: TransformersEngine, forwards: Forwards
) -> None:
    long_request = chat("long", PROMPTS[6], max_tokens=24)
    short_request = chat("short", PROMPTS[0], max_tokens=4)
    solo_long = await alone(engine, long_request)
    solo_short = await alone(engine, short_request)
    forwards.clear()
    long_events = generate(engine, long_request)
    first = await anext(long_events)  # the long one is decoding alone now
    assert isinstance(first, TokenOutput)
    short = await collect(generate(engine, short_request))  # joins, finishes, leaves
    rest = await collect(long_events, taken=len(first.token_ids))
    assert short.tokens == solo_short.tokens
    assert [*first.token_ids, *rest.tokens] == solo_long.tokens
    rows = forwards.decode_rows
    joined = rows.index(2)
    assert 1 in rows[:joined] and rows[joined:].count(2) >= 2, rows  # alone, then together
    assert rows[-1] == 1  # the short one left; the long one went on alone
    assert engine.active_requests == frozenset()


async def test_a_mixed_step_gives_the_tokens_of_separate_prefill_and_decode(
    engine: TransformersEngine, forwards: Forwards, exact: torch.nn.Module
) -> None:
    """Prompts arriving while others decode are read in the decoders' forward (one
    flat sequence, attention per part): each request's greedy tokens are its solo
    ones, its hidden states too (float32 rounding apart), and its prefill shared a
    forward with a decode step."""
    requests = [
        chat(f"m{i}", p, max_tokens=10, return_hidden_states=i < 2)
        for i, p in enumerate(PROMPTS[:4])
    ]
    solo = [await alone(engine, r) for r in requests]
    forwards.clear()
    first = generate(engine, requests[0])
    head = await anext(first)  # decoding alone now
    assert isinstance(head, TokenOutput)
    late = [asyncio.create_task(collect(generate(engine, r))) for r in requests[1:]]
    rest = await collect(first, taken=len(head.token_ids))
    results = await asyncio.gather(*late)
    assert [*head.token_ids, *rest.tokens] == solo[0].tokens
    assert [r.tokens for r in results] == [r.tokens for r in solo[1:]]
    assert forwards.mixed >= 1, forwards.taken
    mixed_hidden = [[head.hidden_states, *rest.hidden], results[0].hidden]
    for request, alone_run, hidden in zip(requests, solo, mixed_hidden, strict=False):
        reference = _exact_states(engine, exact, request, alone_run.tokens)
        mine = torch.cat([h for h in hidden if h is not None])[None]
        single = torch.cat([h for h in alone_run.hidden if h is not None])[None]
        assert_float32_close(mine, single, reference)


def _exact_states(
    engine: TransformersEngine, exact: torch.nn.Module, request: EngineRequest, tokens: list[int]
) -> torch.Tensor:
    """The float64 model's last-layer states where each of ``tokens`` was chosen."""
    encoded = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": request.messages[0][1]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    prompt = cast(BatchEncoding, encoded)["input_ids"]
    ids = torch.tensor([[*prompt, *tokens[:-1]]])
    with torch.inference_mode():
        states = exact(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    return states[:, len(prompt) - 1 :]


async def test_a_cancel_mid_batch_leaves_the_others_unchanged(
    engine: TransformersEngine, forwards: Forwards
) -> None:
    prompts = [PROMPTS[3], PROMPTS[5], PROMPTS[6]]  # answers longer than 16 tokens
    requests = [chat(f"k{i}", p, max_tokens=16) for i, p in enumerate(prompts)]
    solo = [await alone(engine, r) for r in requests]
    forwards.clear()
    keep = [asyncio.create_task(collect(generate(engine, r))) for r in requests[:2]]
    victim = generate(engine, requests[2])
    for _ in range(3):
        assert isinstance(await anext(victim), TokenOutput)
    await victim.aclose()  # the consumer stops: the request leaves at the next step
    assert "k2" not in engine.active_requests
    kept = await asyncio.gather(*keep)
    assert [r.tokens for r in kept] == [r.tokens for r in solo[:2]]
    rows = forwards.decode_rows
    assert 3 in rows and rows[-1] == 2  # three shared steps, then two went on


async def test_only_the_request_that_asks_gets_hidden_states(
    engine: TransformersEngine, exact: torch.nn.Module
) -> None:
    asking = chat("asks", PROMPTS[1], max_tokens=6, return_hidden_states=True)
    plain = chat("plain", PROMPTS[2], max_tokens=6)
    solo = await alone(engine, asking)
    with_states, without = await asyncio.gather(
        collect(generate(engine, asking)), collect(generate(engine, plain))
    )
    assert without.hidden and all(h is None for h in without.hidden)
    rows = [h for h in with_states.hidden if h is not None]
    assert len(rows) == len(with_states.tokens) == 6
    assert all(h.shape == (1, 576) and h.dtype == torch.float32 for h in rows)
    assert with_states.tokens == solo.tokens
    single = [h for h in solo.hidden if h is not None]
    assert len(single) == 6
    # Each state is the last layer's where its token was chosen: at the prompt's last
    # position, then at each generated token but the last.
    message = [{"role": "user", "content": PROMPTS[1]}]
    encoded = engine.tokenizer.apply_chat_template(
        message, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt = cast(BatchEncoding, encoded)["input_ids"]
    ids = torch.tensor([[*prompt, *solo.tokens[:-1]]])
    with torch.inference_mode():
        states = exact(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    reference = states[:, len(prompt) - 1 :]
    # Padded among other rows, the sums run in other blocks: float32 rounding apart.
    assert_float32_close(torch.cat(rows)[None], torch.cat(single)[None], reference)


# -- the KV plan ---------------------------------------------------------------------


@pytest.fixture
def tiny(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[TransformersEngine]:
    torch.manual_seed(0)
    settings = EngineSettings(
        load_format="dummy",
        max_batch_size=8,
        cache_dir=omni_cache_dir,
        engine_args={"config_overrides": TINY_LLAMA, "prefill_tokens": 16},
    )
    engine = TransformersEngine(settings)
    engine.load(smollm2_gguf)
    yield engine
    engine.close()


def test_a_prompt_that_can_never_fit_the_kv_plan_is_refused(tiny: TransformersEngine) -> None:
    tiny.plan_kv_cache(pages=2, page_size=4)  # 8 tokens
    tiny.check(EngineRequest("ok", token_ids=(1, 2, 3), params=SamplingParams(max_tokens=5)))
    with pytest.raises(InvalidArgument) as caught:
        tiny.check(EngineRequest("big", token_ids=tuple(range(1, 9))))
    assert caught.value.field == "inputs.token_ids"
    assert "can never fit the stage's KV cache, which holds 8 tokens (2 x 4-token pages)" in (
        caught.value.message
    )
    with pytest.raises(InvalidArgument) as caught:  # fits, but not with what it asks for
        tiny.check(EngineRequest("long", token_ids=(1, 2, 3), params=SamplingParams(max_tokens=6)))
    assert caught.value.field == "params.max_tokens"
    assert "the stage's KV cache (2 x 4-token pages)" in caught.value.message


async def test_requests_beyond_the_kv_plan_wait_their_turn(tiny: TransformersEngine) -> None:
    tiny.plan_kv_cache(pages=4, page_size=4)  # two requests of 8 tokens at once
    recorder = Forwards(tiny)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        requests = [EngineRequest(f"w{i}", token_ids=(5, 6, 7, 8), params=params) for i in range(3)]
        runs = await asyncio.gather(*(collect(generate(tiny, r)) for r in requests))
    finally:
        recorder.close()
    assert [len(r.tokens) for r in runs] == [4, 4, 4]
    assert max(rows for rows, _ in recorder.shapes) == 2  # never three at once
    finishes = [r.finish for r in runs]
    assert finishes[2] is not None and finishes[0] is not None
    assert finishes[2].queue_ms > finishes[0].queue_ms  # the third waited for pages


async def test_a_long_prompt_does_not_hold_back_a_short_one(tiny: TransformersEngine) -> None:
    """Prefill goes in chunks; the shortest remaining prompt sets the chunk, so a
    short prompt that arrives behind a long one still gets its first token first."""
    recorder = Forwards(tiny)
    firsts: list[str] = []

    async def run(rid: str, prompt: tuple[int, ...]) -> Result:
        params = SamplingParams(temperature=0.0, max_tokens=2)
        run = Result()
        async for event in generate(tiny, EngineRequest(rid, token_ids=prompt, params=params)):
            if isinstance(event, TokenOutput) and not run.tokens:
                firsts.append(rid)
            if isinstance(event, TokenOutput):
                run.tokens.extend(event.token_ids)
        return run

    try:
        long = asyncio.create_task(run("long", tuple(range(10, 410))))  # 400 tokens
        await asyncio.sleep(0)  # submitted first
        await asyncio.gather(long, run("short", (5, 6, 7)))
    finally:
        recorder.close()
    assert firsts == ["short", "long"]
    prefill_columns = [columns for _rows, columns in recorder.shapes if columns > 1]
    assert max(prefill_columns) <= 16  # the long prompt went in chunks of the budget
