"""The vllm engine's intake, without vLLM: prompts become token ids or embeddings,
sampling parameters get their defaults and fit the context, and every refusal
names the field."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from services.engines import text_intake
from services.engines.base import EngineRequest
from services.engines.defaults import TEXT_BUILT_IN, DefaultLayers, TextDefaults
from services.engines.vllm import intake
from services.mesh.errors import InvalidArgument
from tests.helpers.vllm_parts import (
    CHAT_HI,
    EMBEDS,
    byte_ids,
    byte_tokenizer,
    embeds_request,
    request,
)

LIMITS = intake.Limits(
    max_prompt_tokens=32,
    max_model_len=64,
    vocab_size=259,
    hidden_size=8,
    prompt_embeds_enabled=True,
)
DEFAULTS = DefaultLayers(engine=TextDefaults(max_tokens=100), built_in=TEXT_BUILT_IN)


def plan(rq: EngineRequest, limits: intake.Limits = LIMITS) -> intake.Plan:
    return intake.plan(text_intake.check(rq, byte_tokenizer(), limits, DEFAULTS))


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
        (embeds_request(torch.full((4, 8), math.inf)), EMBEDS),
        (request(tensors={"image": torch.ones(1)}), "inputs.tensors.image"),
        (request(max_tokens=0), "params.max_tokens"),
        (request(max_tokens=63), "params.max_tokens"),
        (request(temperature=-0.1), "params.temperature"),
        (request(temperature=math.nan), "params.temperature"),
        (request(top_p=0.0), "params.top_p"),
        (request(top_k=-1), "params.top_k"),
        (request(seed=-1), "params.seed"),
        (request(stop=("",)), "params.stop"),
    ],
)
def test_intake_names_the_bad_field(rq: EngineRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        plan(rq)
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: ")


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
        ("error", None, "abort"),  # a newer vLLM's: short of its end, unasked
        (None, None, "abort"),
    ],
)
def test_finish_reasons_translate(reason: str, stop_reason: Any, ours: str) -> None:
    assert intake.finish_reason(reason, stop_reason) == ours
