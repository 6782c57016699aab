"""The vllm engine. Its intake, arguments and sizing run everywhere; serving a tiny
random-weight Llama needs vLLM and a CUDA GPU and is skipped, with the reason, elsewhere."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from services.engines.base import (
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    SamplingParams,
    TokenOutput,
)
from services.engines.registry import engine_class
from services.engines.vllm import INSTALL_HINT, SamplingDefaults, VllmArgs, VllmEngine, intake
from services.engines.vllm.sizing import model_bytes
from services.mesh.errors import EngineDead, InitFailed, InvalidArgument
from tests.helpers.engine_runs import generate

EMBEDS = "inputs.tensors.prompt_embeds"
HIDDEN = 256  # 4 heads of 64: a head size every attention backend takes
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, no merges: every text encodes and decodes exactly."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def byte_ids(text: str) -> list[int]:
    """The byte tokenizer's ids for ``text``, without BOS."""
    return byte_tokenizer()(text, add_special_tokens=False).input_ids


CHAT_HI = "<user>hi\n<assistant>"  # CHAT_TEMPLATE applied to one user message "hi"


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def request(rid: str = "r", text: str | None = "hello", **params: Any) -> EngineRequest:
    tensors = params.pop("tensors", {})
    messages = params.pop("messages", ())
    token_ids = params.pop("token_ids", ())
    return EngineRequest(
        rid,
        text=text,
        messages=messages,
        token_ids=token_ids,
        tensors=tensors,
        params=SamplingParams(**params),
    )


def embeds_request(embeds: torch.Tensor, **params: Any) -> EngineRequest:
    return request(text=None, tensors={"prompt_embeds": embeds}, **params)


# --- everywhere: no vLLM needed ---------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_load_without_vllm_fails_with_the_install_hint(tmp_path: Path) -> None:
    with pytest.raises(InitFailed) as caught:
        VllmEngine(EngineSettings(device="cuda")).load(tmp_path)
    assert caught.value.message == INSTALL_HINT


def test_a_dead_vllm_engine_is_fatal_for_the_stage() -> None:
    class EngineDeadError(Exception):  # stands in for vllm.v1.engine.exceptions's
        pass

    engine = VllmEngine(EngineSettings(device="cuda"))
    engine._engine_dead = EngineDeadError  # what load() records once vLLM is imported
    dead = engine._translate("r", EngineDeadError("background loop died"))
    assert isinstance(dead, EngineDead) and dead.code.name == "UNAVAILABLE"
    refused = engine._translate("r", ValueError("prompt too long"))
    assert isinstance(refused, InvalidArgument) and refused.field == "inputs"


def test_the_registry_finds_it_without_importing_vllm() -> None:
    code = (
        "import sys; from services.engines.registry import engine_class; "
        "assert engine_class('vllm').name == 'vllm'; assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    assert engine_class("vllm") is VllmEngine


def test_engine_args_map_to_async_engine_args(tmp_path: Path) -> None:
    settings = EngineSettings(
        device="cuda",
        load_format="dummy",
        engine_args={"memory_ratio": 0.5, "enforce_eager": True, "max_model_len": 256},
    )
    kwargs = VllmArgs.from_settings(settings).async_engine_kwargs(settings, tmp_path)
    assert kwargs["model"] == str(tmp_path) and kwargs["load_format"] == "dummy"
    assert kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["enforce_eager"] is True and kwargs["max_model_len"] == 256
    assert "memory_ratio" not in kwargs
    explicit = EngineSettings(engine_args={"memory_ratio": 0.5, "gpu_memory_utilization": 0.7})
    assert VllmArgs.from_settings(explicit).async_engine_kwargs(explicit, tmp_path)[
        "gpu_memory_utilization"
    ] == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("engine_args", "field"),
    [
        ({"model": "x"}, "engine_args.model"),
        ({"load_format": "dummy"}, "engine_args.load_format"),
        ({"memory_ratio": 1.5}, "engine_args.memory_ratio"),
        ({"defaults": {"max_new_tokens": 3}}, "engine_args.defaults"),
    ],
)
def test_bad_engine_args_are_refused_by_name(engine_args: dict[str, Any], field: str) -> None:
    with pytest.raises(InitFailed) as caught:
        VllmEngine(EngineSettings(engine_args=engine_args))
    assert caught.value.field == field


LIMITS = intake.Limits(
    max_prompt_tokens=32,
    max_model_len=64,
    vocab_size=259,
    hidden_size=8,
    prompt_embeds_enabled=True,
)


def plan(rq: EngineRequest, limits: intake.Limits = LIMITS) -> intake.Plan:
    return intake.plan(rq, byte_tokenizer(), limits, SamplingDefaults(max_tokens=100))


def test_prompts_become_token_ids_or_embeddings() -> None:
    text = plan(request(text="hi"))
    assert text.prompt == {"prompt_token_ids": [1, *byte_ids("hi")]} and text.prompt_tokens == 3
    chat = plan(request(text=None, messages=(("user", "hi"),)))
    assert chat.prompt == {"prompt_token_ids": byte_ids(CHAT_HI)}  # the template, no second BOS
    ids = plan(request(text=None, token_ids=(5, 6, 7)))
    assert ids.prompt == {"prompt_token_ids": [5, 6, 7]} and ids.prompt_tokens == 3
    embeds = plan(embeds_request(torch.ones(1, 4, 8)))
    assert embeds.prompt["prompt_embeds"].shape == (4, 8) and embeds.prompt_tokens == 4


def test_sampling_defaults_fill_in_and_fit_the_context() -> None:
    sampling = plan(request(text="hi", seed=3, stop=("x",))).sampling
    assert sampling["max_tokens"] == 64 - 3  # the default of 100 capped by the room left
    assert sampling["seed"] == 3 and sampling["stop"] == ["x"]
    assert "top_k" not in sampling  # 0 means off: left unset for vLLM
    chosen = plan(request(top_k=5, max_tokens=4)).sampling
    assert (chosen["top_k"], chosen["max_tokens"]) == (5, 4)


@pytest.mark.parametrize(
    ("rq", "field"),
    [
        (request(text=None), "inputs"),
        (request(token_ids=(1, 2)), "inputs"),
        (request(text="x" * 40), "inputs.text"),
        (request(text=None, token_ids=(1, 999)), "inputs.token_ids"),
        (embeds_request(torch.ones(4, 7)), EMBEDS),
        (embeds_request(torch.ones(2, 4, 8)), EMBEDS),
        (embeds_request(torch.ones(4, 8, dtype=torch.int32)), EMBEDS),
        (request(tensors={"image": torch.ones(1)}), "inputs.tensors.image"),
        (request(max_tokens=0), "params.max_tokens"),
        (request(max_tokens=63), "params.max_tokens"),
        (request(temperature=-0.1), "params.temperature"),
        (request(top_p=0.0), "params.top_p"),
        (request(top_k=-1), "params.top_k"),
        (request(seed=-1), "params.seed"),
    ],
)  # fmt: skip
def test_intake_names_the_bad_field(rq: EngineRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        plan(rq)
    assert caught.value.field == field


def test_prompt_embeds_need_the_engine_arg() -> None:
    off = intake.Limits(32, 64, 259, 8, prompt_embeds_enabled=False)
    with pytest.raises(InvalidArgument, match="enable_prompt_embeds") as caught:
        plan(embeds_request(torch.ones(4, 8)), off)
    assert caught.value.field == EMBEDS


@pytest.mark.parametrize(
    ("reason", "stop_reason", "ours"),
    [
        ("stop", None, "eos"),
        ("stop", "###", "stop"),
        ("stop", 7, "stop"),
        ("length", None, "length"),
        ("abort", None, "abort"),
    ],
)  # fmt: skip
def test_finish_reasons_translate(reason: str, stop_reason: Any, ours: str) -> None:
    assert intake.finish_reason(reason, stop_reason) == ours


def test_model_bytes_count_the_architecture_per_rank(tmp_path: Path) -> None:
    config = tiny_llama_config(259)
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert model_bytes(config, torch.bfloat16, 1, tmp_path) == 2 * params
    assert model_bytes(config, torch.bfloat16, 2, tmp_path) == params


# --- GPU: a tiny random-weight Llama served by vLLM ---------------------------------


def _gpu_skip_reason() -> str:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (GPU image only: pip install 'omni-mesh[gpu]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    return ""


GPU_SKIP = _gpu_skip_reason()
gpu_only = pytest.mark.skipif(bool(GPU_SKIP), reason=GPU_SKIP)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(folder)
    tiny_llama_config(len(tokenizer)).save_pretrained(folder)
    settings = EngineSettings(
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_prompt_tokens=128,
        engine_args={
            "enforce_eager": True,  # no graph capture: the test starts in seconds
            "max_model_len": 256,
            "memory_ratio": 0.2,
            "enable_prompt_embeds": True,
        },
    )
    engine = VllmEngine(settings)
    info = engine.load(folder)
    assert info.kv is not None and (info.kv.layers, info.kv.kv_heads) == (2, 2)
    assert (info.kv.head_dim, info.kv.dtype_bytes) == (64, 2) and info.model_bytes > 0
    yield engine
    engine.close()


async def collect(stream: AsyncIterator[EngineEvent]) -> list[EngineEvent]:
    async def drain() -> list[EngineEvent]:
        return [event async for event in stream]

    return await asyncio.wait_for(drain(), timeout=120)


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenOutput) for t in e.token_ids]


@pytest.mark.gpu
@gpu_only
async def test_tokens_stream_as_deltas(served: VllmEngine) -> None:
    events = await collect(generate(served, request(max_tokens=12, temperature=0.0)))
    finish = events[-1]
    assert isinstance(finish, FinishOutput) and finish.reason in {"length", "eos"}
    deltas = [e for e in events if isinstance(e, TokenOutput)]
    tokens = tokens_of(events)
    assert finish.completion_tokens == len(tokens) and finish.prompt_tokens == 6
    if finish.reason == "length":
        assert len(tokens) == 12 and len(deltas) > 1  # streamed, not one final blob


@pytest.mark.gpu
@gpu_only
async def test_same_seed_same_tokens(served: VllmEngine) -> None:
    a = tokens_of(await collect(generate(served, request("a", max_tokens=8, seed=11))))
    b = tokens_of(await collect(generate(served, request("b", max_tokens=8, seed=11))))
    assert a == b


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize(
    ("inputs", "prompt_tokens"),
    [
        ({"text": None, "messages": (("user", "hi"),)}, len(byte_ids(CHAT_HI))),
        ({"text": None, "token_ids": (5, 6, 7)}, 3),
        ({"text": None, "tensors": {"prompt_embeds": torch.randn(1, 4, HIDDEN)}}, 4),
    ],
)
async def test_every_prompt_kind_generates(
    served: VllmEngine, inputs: dict[str, Any], prompt_tokens: int
) -> None:
    events = await collect(generate(served, request(max_tokens=4, **inputs)))
    finish = events[-1]
    assert isinstance(finish, FinishOutput) and finish.prompt_tokens == prompt_tokens
    assert 1 <= finish.completion_tokens <= 4


@pytest.mark.gpu
@gpu_only
async def test_closing_the_stream_frees_the_request(served: VllmEngine) -> None:
    stream = generate(served, request("left", max_tokens=200))
    await asyncio.wait_for(anext(stream), timeout=60)  # type: ignore[call-overload]
    await stream.aclose()  # type: ignore[attr-defined]
    llm: Any = served._llm
    for _ in range(50):  # vLLM frees it on its own output task
        if llm.output_processor.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.1)
    assert llm.output_processor.get_num_unfinished_requests() == 0
    after = await collect(generate(served, request("after", max_tokens=2)))
    assert isinstance(after[-1], FinishOutput)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize(
    ("rq", "field"),
    [
        (embeds_request(torch.randn(4, HIDDEN + 1)), EMBEDS),
        (request(max_tokens=1000), "params.max_tokens"),
        (request(text=None, token_ids=(1, 10_000)), "inputs.token_ids"),
    ],
)
def test_check_names_the_bad_field_on_the_gpu(
    served: VllmEngine, rq: EngineRequest, field: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        served.check(rq)
    assert caught.value.field == field
