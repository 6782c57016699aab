"""What the transformers engine refuses at intake, on the real SmolLM2 tokenizer:
each refusal names the field, and generate refuses what check refuses."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from services.engines.base import EngineRequest, SamplingParams
from services.engines.transformers import TransformersEngine
from services.mesh.errors import InvalidArgument
from tests.helpers.text_engine import Tiny, req

BAD = [
    (req(), "inputs"),
    (req(text="hi", token_ids=(1, 2)), "inputs"),
    (req(token_ids=(1, 10**6)), "inputs.token_ids"),
    (req(text="hi", params=SamplingParams(max_tokens=0)), "params.max_tokens"),
    (req(text="hi", params=SamplingParams(max_tokens=9000)), "params.max_tokens"),
    (req(text="hi", params=SamplingParams(temperature=-0.5)), "params.temperature"),
    (req(text="hi", params=SamplingParams(temperature=math.inf)), "params.temperature"),
    (req(text="hi", params=SamplingParams(temperature=math.nan)), "params.temperature"),
    (req(text="hi", params=SamplingParams(top_p=0.0)), "params.top_p"),
    (req(text="hi", params=SamplingParams(top_p=1.5)), "params.top_p"),
    (req(text="hi", params=SamplingParams(top_p=math.nan)), "params.top_p"),
    (req(text="hi", params=SamplingParams(top_k=-1)), "params.top_k"),
    (req(text="hi", params=SamplingParams(seed=2**63)), "params.seed"),
    (req(text="hi", params=SamplingParams(stop=("",))), "params.stop"),
    (req(tensors={"prompt_embeds": torch.zeros(3, 7)}), "inputs.tensors.prompt_embeds"),
    (req(tensors={"prompt_embeds": torch.zeros(0, 576)}), "inputs.tensors.prompt_embeds"),
    (
        req(tensors={"prompt_embeds": torch.full((3, 576), math.nan)}),
        "inputs.tensors.prompt_embeds",
    ),
    (req(text="hi", tensors={"audio": torch.zeros(3)}), "inputs.tensors.audio"),
]


@pytest.mark.parametrize(("request_", "field"), BAD, ids=[f for _, f in BAD])
async def test_check_names_the_field(
    smollm2_engine: TransformersEngine, request_: EngineRequest, field: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        smollm2_engine.check(request_)
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: ")


def test_empty_text_counts_as_no_input(smollm2_engine: TransformersEngine) -> None:
    # The one presence rule of every engine (services/engines/request_checks.py).
    smollm2_engine.check(req(text="", token_ids=(1, 2)))  # one input: the ids
    with pytest.raises(InvalidArgument) as caught:
        smollm2_engine.check(req(text=""))
    assert caught.value.field == "inputs"


def test_prompt_over_the_limit_is_refused(
    tiny_smollm2: Tiny, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    text = "What is the capital of France, my dear friend?"
    n = len(smollm2_tokenizer(text)["input_ids"])
    assert n > 8
    tiny_smollm2.engine.check(req(text="What is the capital?"))
    with pytest.raises(InvalidArgument) as caught:
        tiny_smollm2.engine.check(req(text=text))
    assert caught.value.message == f"inputs.text: prompt has {n} tokens, the limit is 8"
    assert caught.value.field == "inputs.text"
