"""The transformers engine against the real SmolLM2-135M-Instruct (GGUF), on CPU."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.engines.base import (
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    KvGeometry,
    ModelInfo,
    SamplingParams,
    TokenOutput,
)
from services.engines.registry import engine_class
from services.engines.transformers import TransformersEngine
from services.engines.transformers.loading import converted_folder
from services.engines.transformers.sampling import Sampling, sample
from services.engines.transformers.text import IncrementalDetokenizer, StopStrings
from services.mesh.errors import InvalidArgument
from tests.helpers.engine_runs import generate
from tests.helpers.stage import TINY_LLAMA

FRANCE = (("user", "What is the capital of France?"),)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
TINY = TINY_LLAMA


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    hidden: list[torch.Tensor | None] = field(default_factory=list)
    finish: FinishOutput | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect(events: AsyncIterator[EngineEvent]) -> Result:
    result = Result()
    async for event in events:
        assert result.finish is None, "nothing may follow FinishOutput"
        if isinstance(event, TokenOutput):
            result.tokens.extend(event.token_ids)
            result.texts.append(event.text)
            result.hidden.append(event.hidden_states)
        else:
            assert isinstance(event, FinishOutput)
            result.finish = event
    assert result.finish is not None
    assert result.finish.completion_tokens == len(result.tokens)
    return result


def req(rid: str = "r", params: SamplingParams = GREEDY, **inputs: object) -> EngineRequest:
    return EngineRequest(request_id=rid, params=params, **inputs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(EngineSettings(cache_dir=omni_cache_dir, max_batch_size=4))
    engine.load(smollm2_gguf)
    engine.warmup()
    yield engine
    engine.close()


@dataclass(frozen=True)
class Tiny:
    engine: TransformersEngine
    info: ModelInfo


@pytest.fixture(scope="module")
def tiny(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[Tiny]:
    torch.manual_seed(0)  # fixed random weights, so greedy output is reproducible
    settings = EngineSettings(
        load_format="dummy",
        max_prompt_tokens=8,
        cache_dir=omni_cache_dir,
        engine_args={"config_overrides": TINY},
    )
    engine = TransformersEngine(settings)
    info = engine.load(smollm2_gguf)
    yield Tiny(engine, info)
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(
    engine: TransformersEngine, smollm2_gguf: Path, omni_cache_dir: Path
) -> PreTrainedTokenizerBase:
    # `engine` first, so the converted folder exists.
    return AutoTokenizer.from_pretrained(converted_folder(smollm2_gguf, omni_cache_dir))


# -- loading -----------------------------------------------------------------------


def test_registry_names_the_engine() -> None:
    assert engine_class("transformers") is TransformersEngine


def test_second_gguf_load_reuses_the_conversion(
    engine: TransformersEngine, smollm2_gguf: Path, omni_cache_dir: Path
) -> None:
    folder = converted_folder(smollm2_gguf, omni_cache_dir)  # `engine` converted it
    # The parent's mtime moves if a conversion so much as creates a temp folder.
    watched = [folder.parent, folder, *folder.iterdir()]
    before = [p.stat().st_mtime_ns for p in watched]
    again = TransformersEngine(EngineSettings(cache_dir=omni_cache_dir))
    try:
        info = again.load(smollm2_gguf)
    finally:
        again.close()
    assert [p.stat().st_mtime_ns for p in watched] == before
    assert info.kv == KvGeometry(layers=30, kv_heads=3, head_dim=64, dtype_bytes=4)
    # ~135M float32 parameters, plus the packed copy of the output projection, which
    # shares its 49152 x 576 weight with the input embeddings (packed_linear.py).
    tied = 49152 * 576 * 4
    assert 130e6 * 4 + tied < info.model_bytes < 140e6 * 4 + tied
    assert not list(folder.parent.glob(f".{folder.name}.*")), "a temp folder was left behind"


async def test_dummy_weights_give_a_tiny_model_with_the_real_tokenizer(
    tiny: Tiny, engine: TransformersEngine
) -> None:
    assert tiny.info.kv == KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
    # Mostly the 49152-row embedding, twice: the tied output projection's packed copy.
    assert tiny.info.model_bytes < 32 * 2**20
    text = "What is the capital of France?"
    params = SamplingParams(temperature=0.0, max_tokens=4)  # seeded weights: no stray EOS
    small = await collect(generate(tiny.engine, req(text=text, params=params)))
    real = await collect(generate(engine, req(text=text, params=SamplingParams(max_tokens=1))))
    assert small.finish == FinishOutput("length", real.finish.prompt_tokens, 4)  # type: ignore[union-attr]


# -- generation --------------------------------------------------------------------


async def test_greedy_chat_answers_paris_and_ends_at_eos(engine: TransformersEngine) -> None:
    result = await collect(generate(engine, req(messages=FRANCE)))
    assert "Paris" in result.text
    assert result.finish is not None and result.finish.reason == "eos"
    assert result.finish.prompt_tokens > 20  # the template's system prompt was added


async def test_same_seed_same_text_other_seeds_differ(engine: TransformersEngine) -> None:
    async def run(seed: int) -> str:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
        return (
            await collect(generate(engine, req(text="My favourite animal is", params=params)))
        ).text

    first = await run(1)
    assert await run(1) == first
    assert {await run(2), await run(3)} != {first}


async def test_stop_string_cuts_the_text(engine: TransformersEngine) -> None:
    for stop, expected in (("Paris", "The capital of France is "), ("of Fr", "The capital ")):
        params = SamplingParams(temperature=0.0, max_tokens=16, stop=("never", stop))
        result = await collect(generate(engine, req(messages=FRANCE, params=params)))
        assert result.text == expected
        assert result.finish is not None and result.finish.reason == "stop"


async def test_max_tokens_ends_with_length(
    engine: TransformersEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5)
    result = await collect(generate(engine, req(text="Once upon a time", params=params)))
    assert len(result.tokens) == 5
    n_prompt = len(tokenizer("Once upon a time")["input_ids"])
    assert result.finish == FinishOutput("length", prompt_tokens=n_prompt, completion_tokens=5)
    assert result.text == tokenizer.decode(result.tokens, skip_special_tokens=True)


async def test_hidden_states_come_one_row_per_token(engine: TransformersEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, return_hidden_states=True)
    result = await collect(generate(engine, req(text="Once upon a time", params=params)))
    rows = [h for h in result.hidden if h is not None]
    assert len(rows) == 3
    assert all(h.shape == (1, 576) and h.dtype == torch.float32 for h in rows)
    assert not torch.equal(rows[0], rows[1])
    plain = await collect(generate(engine, req(text="Once upon a time", params=GREEDY)))
    assert plain.hidden[0] is None


async def test_prompt_embeds_replace_tokens(
    engine: TransformersEngine,
    tokenizer: PreTrainedTokenizerBase,
    smollm2_gguf: Path,
    omni_cache_dir: Path,
) -> None:
    ids = tuple(tokenizer("Once upon a time")["input_ids"])
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
    by_ids = await collect(generate(engine, req(token_ids=ids, params=params)))
    by_embeds = await collect(
        generate(engine, req(tensors={"prompt_embeds": embeds}, params=params))
    )
    assert by_embeds.tokens == by_ids.tokens
    assert by_embeds.finish.prompt_tokens == len(ids)  # type: ignore[union-attr]


# -- concurrency and cancellation -------------------------------------------------


async def test_concurrent_requests_interleave_and_match_solo_runs(
    engine: TransformersEngine,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompts = {"a": "Once upon a time", "b": "The quick brown fox"}
    solo = {
        k: (await collect(generate(engine, req(k, text=p, params=params)))).text
        for k, p in prompts.items()
    }
    order: list[tuple[str, str]] = []

    async def run(rid: str) -> str:
        texts = []
        async for event in generate(engine, req(rid, text=prompts[rid], params=params)):
            order.append((rid, type(event).__name__))
            if isinstance(event, TokenOutput):
                texts.append(event.text)
        return "".join(texts)

    together = dict(zip("ab", await asyncio.gather(run("a"), run("b")), strict=True))
    assert together == solo
    first_finish = min(i for i, (_, kind) in enumerate(order) if kind == "FinishOutput")
    assert {rid for rid, _ in order[:first_finish]} == {"a", "b"}


async def test_aclose_stops_one_request_while_the_other_completes(
    engine: TransformersEngine,
) -> None:
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


async def test_task_cancel_frees_the_request(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=64)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in generate(engine, req("c", text="Hi", params=params)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    assert "c" in engine.active_requests
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.active_requests == frozenset()


# -- intake validation -------------------------------------------------------------

BAD = [
    (req(), "inputs"),
    (req(text="hi", token_ids=(1, 2)), "inputs"),
    (req(token_ids=(1, 10**6)), "inputs.token_ids"),
    (req(text="hi", params=SamplingParams(max_tokens=0)), "params.max_tokens"),
    (req(text="hi", params=SamplingParams(max_tokens=9000)), "params.max_tokens"),
    (req(text="hi", params=SamplingParams(temperature=-0.5)), "params.temperature"),
    (req(text="hi", params=SamplingParams(top_p=0.0)), "params.top_p"),
    (req(text="hi", params=SamplingParams(top_p=1.5)), "params.top_p"),
    (req(text="hi", params=SamplingParams(top_k=-1)), "params.top_k"),
    (req(text="hi", params=SamplingParams(stop=("",))), "params.stop"),
    (req(tensors={"prompt_embeds": torch.zeros(3, 7)}), "inputs.tensors.prompt_embeds"),
    (req(text="hi", tensors={"audio": torch.zeros(3)}), "inputs.tensors.audio"),
]


@pytest.mark.parametrize(("request_", "field"), BAD, ids=[f for _, f in BAD])
async def test_check_names_the_field(
    engine: TransformersEngine, request_: EngineRequest, field: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        engine.check(request_)
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: ")


def test_prompt_over_the_limit_is_refused(tiny: Tiny, tokenizer: PreTrainedTokenizerBase) -> None:
    text = "What is the capital of France, my dear friend?"
    n = len(tokenizer(text)["input_ids"])
    assert n > 8
    tiny.engine.check(req(text="What is the capital?"))
    with pytest.raises(InvalidArgument) as caught:
        tiny.engine.check(req(text=text))
    assert caught.value.message == f"inputs.text: prompt has {n} tokens, the limit is 8"
    assert caught.value.field == "inputs.text"


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        (EngineSettings(engine_args={"dtyp": "float32"}), "unknown keys"),
        (EngineSettings(dtype="float64"), "dtype"),
        (EngineSettings(engine_args={"defaults": {"max_token": 4}}), "engine_args.defaults"),
        (EngineSettings(engine_args={"config_overrides": TINY}), "needs load_format: dummy"),
    ],
)
def test_bad_engine_args_fail_at_construction(settings: EngineSettings, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        TransformersEngine(settings)


def test_engine_declares_its_contract() -> None:
    assert TransformersEngine.name == "transformers"
    assert TransformersEngine.output_tensors == ("hidden_states",)
    assert "seed" in TransformersEngine.supported_params
    assert "num_inference_steps" not in TransformersEngine.supported_params


# -- text: detokenizer, stop strings, sampling -------------------------------------


def test_detokenizer_never_splits_a_character(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Café 你好 🙂 naïve ok"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some byte-level token ended mid-character and was held


def test_detokenizer_flush_shows_a_cut_character(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("ok 你好")["input_ids"]  # 好 takes two byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer("Say:")["input_ids"])
    emitted = "".join(detok.add(i) for i in ids[:-1])
    assert emitted == "ok 你"
    assert detok.flush().endswith("\ufffd")


def test_stop_strings_hold_back_and_cut() -> None:
    stops = StopStrings(["STOP", "end."])
    assert stops.add("abc ST") == "abc "
    assert stops.add("AY S") == "STAY "
    assert stops.add("TO") == ""
    assert stops.add("P and more") == ""
    assert stops.stopped and stops.flush() == "" and stops.add("x") == ""

    earliest = StopStrings(["b", "a"])
    assert earliest.add("xxab") == "xx"

    tail = StopStrings(["end."])
    assert tail.add("the en") == "the "
    assert tail.flush() == "en"
    assert StopStrings([]).add("anything") == "anything"


def test_sampling_cuts_degenerate_to_greedy() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    for sampling in (Sampling(0.0, 1.0, 0), Sampling(1.0, 1.0, 1), Sampling(1.0, 0.01, 0)):
        assert {sample(logits, sampling, gen) for _ in range(20)} == {1}
    spread = {sample(logits, Sampling(1.0, 1.0, 2), gen) for _ in range(50)}
    assert spread == {1, 2}
