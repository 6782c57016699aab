from __future__ import annotations

import pytest
import torch

from services.mesh import tensors as codec
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2
from services.stage.transforms import apply_transform


def upstream(transform: str) -> stage_pb2.Submit:
    submit = stage_pb2.Submit(request_id="r", transform=transform, is_last=True)
    submit.inputs.text = "The capital is Paris."
    submit.inputs.token_ids.extend([1, 2, 3])
    submit.inputs.tensors.append(codec.to_proto(torch.ones(3, 8), "hidden_states"))
    return submit


def test_no_transform_leaves_inputs_alone() -> None:
    submit = upstream("")
    apply_transform(submit)
    assert submit.inputs == upstream("").inputs


def test_text_becomes_a_user_message() -> None:
    submit = upstream("text")
    apply_transform(submit)
    assert [(m.role, m.content) for m in submit.inputs.messages] == [
        ("user", "The capital is Paris.")
    ]
    assert not submit.inputs.text and not submit.inputs.token_ids and not submit.inputs.tensors


def test_tokens_pass_alone() -> None:
    submit = upstream("tokens")
    apply_transform(submit)
    assert list(submit.inputs.token_ids) == [1, 2, 3] and not submit.inputs.text


def test_hidden_states_become_prompt_embeds() -> None:
    submit = upstream("hidden_states_to_prompt_embeds")
    apply_transform(submit)
    (embeds,) = submit.inputs.tensors
    assert embeds.name == "prompt_embeds" and list(embeds.shape) == [3, 8]
    assert not submit.inputs.text and not submit.inputs.token_ids
    empty = stage_pb2.Submit(transform="hidden_states_to_prompt_embeds")
    with pytest.raises(InvalidArgument, match="needs a 'hidden_states' tensor"):
        apply_transform(empty)


def test_unknown_transform_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument) as err:
        apply_transform(stage_pb2.Submit(transform="vocode"))
    assert (
        err.value.field == "submit.transform"
        and "hidden_states_to_prompt_embeds" in err.value.message
    )
