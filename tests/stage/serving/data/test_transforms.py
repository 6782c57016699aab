from __future__ import annotations

import pytest
import torch

from services.mesh.errors import InvalidArgument
from services.stage.serving.inputs import Inputs
from services.stage.serving.transforms import TRANSFORMS, apply_transform

UPSTREAM = Inputs(
    text="The capital is Paris.",
    token_ids=(1, 2, 3),
    tensors={"hidden_states": torch.ones(3, 8)},
)


def test_no_transform_leaves_inputs_alone() -> None:
    assert apply_transform("", UPSTREAM) is UPSTREAM


def test_text_becomes_a_user_message() -> None:
    got = apply_transform("text", UPSTREAM)
    assert got == Inputs(messages=(("user", "The capital is Paris."),))


def test_tokens_pass_alone() -> None:
    assert apply_transform("tokens", UPSTREAM) == Inputs(token_ids=(1, 2, 3))


def test_hidden_states_become_prompt_embeds_whole() -> None:
    got = apply_transform("hidden_states_to_prompt_embeds", UPSTREAM)
    assert list(got.tensors) == ["prompt_embeds"] and got.tensors["prompt_embeds"].shape == (3, 8)
    assert not got.text and not got.token_ids
    with pytest.raises(InvalidArgument, match="needs a 'hidden_states' tensor"):
        apply_transform("hidden_states_to_prompt_embeds", Inputs(text="x"))


def test_unknown_transform_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument) as err:
        apply_transform("vocode", UPSTREAM)
    assert err.value.field == "submit.transform"
    assert "hidden_states_to_prompt_embeds" in err.value.message


def test_each_transform_says_what_it_needs() -> None:
    info = {name: t.info() for name, t in TRANSFORMS.items()}
    assert list(info["hidden_states_to_prompt_embeds"].needs_tensors) == ["hidden_states"]
    assert not info["text"].needs_tensors and all(i.description for i in info.values())
