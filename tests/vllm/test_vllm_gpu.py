"""The vllm engine serving a tiny random-weight Llama: needs vLLM and a CUDA GPU,
and is skipped, with the reason, elsewhere."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.engines.base import (
    EngineRequest,
    EngineSettings,
    FinishOutput,
    TokenOutput,
)
from services.engines.vllm import VllmEngine
from services.mesh.errors import InvalidArgument
from services.testing.engine_runs import collect, generate, tokens_of
from tests.helpers.polling import eventually
from tests.helpers.vllm_parts import (
    CHAT_HI,
    EMBEDS,
    HIDDEN,
    byte_ids,
    byte_tokenizer,
    embeds_request,
    request,
    tiny_llama_config,
)


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
    await asyncio.wait_for(anext(stream), timeout=60)
    await stream.aclose()
    llm: Any = served._llm
    # vLLM frees it on its own output task.
    unfinished = llm.output_processor.get_num_unfinished_requests
    await eventually(lambda: unfinished() == 0, 5, message="not freed")
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
