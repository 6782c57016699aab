"""The transformers engine generating on the real SmolLM2-135M-Instruct (GGUF), on
CPU: greedy answers, seeds, stop strings, hidden states, embeddings, defaults,
concurrent requests and cancellation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from services.engines.base import EngineSettings, FinishOutput, SamplingParams, TokenOutput
from services.engines.defaults import RequestDefaults
from services.engines.transformers import TransformersEngine
from services.engines.transformers.loading import converted_folder
from services.testing.configs import TINY_LLAMA
from services.testing.engine_runs import generate
from tests.helpers.reference_answer import ReferenceLM
from tests.helpers.text_engine import FRANCE, GREEDY, collect, req


async def test_greedy_chat_answers_as_float32_does_and_ends_at_eos(
    smollm2_engine: TransformersEngine, smollm2_reference: ReferenceLM
) -> None:
    result = await collect(generate(smollm2_engine, req(messages=FRANCE)))
    said = smollm2_reference.answer(FRANCE[0][1], GREEDY.max_tokens or 0)
    said.assert_said(result.tokens)
    if said.complete:  # the reference's own end, where rounding cannot move it
        ended = "eos" if len(said.token_ids) < (GREEDY.max_tokens or 0) else "length"
        assert result.finish is not None and result.finish.reason == ended
    assert result.finish.prompt_tokens > 20  # the template's system prompt was added


async def test_same_seed_same_text_other_seeds_differ(smollm2_engine: TransformersEngine) -> None:
    async def run(seed: int) -> str:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
        prompt = req(text="My favourite animal is", params=params)
        return (await collect(generate(smollm2_engine, prompt))).text

    first = await run(1)
    assert await run(1) == first
    assert {await run(2), await run(3)} != {first}


async def test_stop_string_cuts_the_text(
    smollm2_engine: TransformersEngine, smollm2_reference: ReferenceLM
) -> None:
    # Stops taken from what this machine's float32 run says for sure: its last
    # decided word, and five characters across a word boundary in its middle.
    text = smollm2_reference.answer(FRANCE[0][1], 16).decided_text.rstrip(" .")
    assert len(text) >= 10, f"too little of the answer is decided to test stops: {text!r}"
    middle = text.index(" ", len(text) // 3) - 2
    stops = (text.rsplit(" ", 1)[-1], text[middle : middle + 5])
    for stop, expected in ((s, text[: text.index(s)]) for s in stops):
        params = SamplingParams(temperature=0.0, max_tokens=16, stop=("never", stop))
        result = await collect(generate(smollm2_engine, req(messages=FRANCE, params=params)))
        assert result.text == expected
        assert result.finish is not None and result.finish.reason == "stop"


async def test_max_tokens_ends_with_length(
    smollm2_engine: TransformersEngine, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5)
    result = await collect(generate(smollm2_engine, req(text="Once upon a time", params=params)))
    assert len(result.tokens) == 5
    n_prompt = len(smollm2_tokenizer("Once upon a time")["input_ids"])
    assert result.finish == FinishOutput("length", prompt_tokens=n_prompt, completion_tokens=5)
    assert result.text == smollm2_tokenizer.decode(result.tokens, skip_special_tokens=True)


async def test_hidden_states_come_one_row_per_token(smollm2_engine: TransformersEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, return_hidden_states=True)
    result = await collect(generate(smollm2_engine, req(text="Once upon a time", params=params)))
    rows = [h for h in result.hidden if h is not None]
    assert len(rows) == 3
    assert all(h.shape == (1, 576) and h.dtype == torch.float32 for h in rows)
    assert not torch.equal(rows[0], rows[1])
    plain = await collect(generate(smollm2_engine, req(text="Once upon a time", params=GREEDY)))
    assert plain.hidden[0] is None


async def test_prompt_embeds_replace_tokens(
    smollm2_engine: TransformersEngine,
    smollm2_tokenizer: PreTrainedTokenizerBase,
    smollm2_gguf: Path,
    omni_cache_dir: Path,
) -> None:
    ids = tuple(smollm2_tokenizer("Once upon a time")["input_ids"])
    weights = converted_folder(smollm2_gguf, omni_cache_dir) / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        # Tied weights are saved once, under either name.
        name = (
            "model.embed_tokens.weight"
            if "model.embed_tokens.weight" in f.keys()
            else "lm_head.weight"
        )
        embeds = f.get_tensor(name)[list(ids)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    by_ids = await collect(generate(smollm2_engine, req(token_ids=ids, params=params)))
    for given in (embeds, embeds[None]):  # [seq, hidden], or with a leading batch of one
        by_embeds = await collect(
            generate(smollm2_engine, req(tensors={"prompt_embeds": given}, params=params))
        )
        assert by_embeds.tokens == by_ids.tokens
        assert by_embeds.finish.prompt_tokens == len(ids)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("asked", "stage", "engine_args", "generated"),
    [
        (2, 3, 4, 2),  # the request's own value
        (None, 3, 4, 3),  # the stage file's `defaults:`
        (None, None, 4, 4),  # engine_args.defaults
    ],
)
async def test_each_layer_of_defaults_wins_in_turn(
    smollm2_gguf: Path,
    omni_cache_dir: Path,
    asked: int | None,
    stage: int | None,
    engine_args: int | None,
    generated: int,
) -> None:
    # The precedence of defaults.resolve, seen through the engine; built-in values
    # are in tests/engines/test_defaults.py.
    settings = EngineSettings(
        load_format="dummy",
        cache_dir=omni_cache_dir,
        engine_args={"config_overrides": TINY_LLAMA, "defaults": {"max_tokens": engine_args}},
        defaults=RequestDefaults(max_tokens=stage, temperature=0.0),
    )
    torch.manual_seed(0)  # fixed random weights: greedy output runs to its length
    engine = TransformersEngine(settings)
    try:
        engine.load(smollm2_gguf)
        params = SamplingParams(max_tokens=asked)
        result = await collect(generate(engine, req(text="Once upon a time", params=params)))
    finally:
        engine.close()
    assert result.finish is not None and result.finish.reason == "length"
    assert len(result.tokens) == generated


# -- concurrency and cancellation -------------------------------------------------


async def test_concurrent_requests_interleave_and_match_solo_runs(
    smollm2_engine: TransformersEngine,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompts = {"a": "Once upon a time", "b": "The quick brown fox"}
    solo = {
        k: (await collect(generate(smollm2_engine, req(k, text=p, params=params)))).text
        for k, p in prompts.items()
    }
    order: list[tuple[str, str]] = []

    async def run(rid: str) -> str:
        texts = []
        async for event in generate(smollm2_engine, req(rid, text=prompts[rid], params=params)):
            order.append((rid, type(event).__name__))
            if isinstance(event, TokenOutput):
                texts.append(event.text)
        return "".join(texts)

    together = dict(zip("ab", await asyncio.gather(run("a"), run("b")), strict=True))
    assert together == solo
    first_finish = min(i for i, (_, kind) in enumerate(order) if kind == "FinishOutput")
    assert {rid for rid, _ in order[:first_finish]} == {"a", "b"}


async def test_aclose_stops_one_request_while_the_other_completes(
    smollm2_engine: TransformersEngine,
) -> None:
    engine = smollm2_engine
    long = generate(
        engine, req("long", text="Count: one, two,", params=SamplingParams(max_tokens=64))
    )
    other = asyncio.create_task(
        collect(generate(engine, req("other", text="Hello", params=SamplingParams(max_tokens=8))))
    )
    for _ in range(2):
        assert isinstance(await anext(long), TokenOutput)
    assert "long" in engine.active_requests
    await long.aclose()
    assert "long" not in engine.active_requests
    result = await other
    assert len(result.tokens) == 8 or result.finish.reason == "eos"  # type: ignore[union-attr]
    assert engine.active_requests == frozenset()


async def test_task_cancel_frees_the_request(smollm2_engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=64)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in generate(smollm2_engine, req("c", text="Hi", params=params)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    assert "c" in smollm2_engine.active_requests
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert smollm2_engine.active_requests == frozenset()
