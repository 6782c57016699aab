"""Input processors a consuming stage applies to what an upstream stage produced
(named by the pipeline edge's ``transform``, carried in ``Submit.transform``).

They work on the wire message, before engine validation, so an engine sees an
ordinary request: a prompt, token ids, or prompt embeddings.
"""

from __future__ import annotations

from collections.abc import Callable

from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2


def _text(inputs: stage_pb2.StageInputs) -> None:
    """Upstream text becomes this stage's prompt, as a user message of a chat."""
    text = inputs.text
    inputs.Clear()
    inputs.messages.add(role="user", content=text)


def _tokens(inputs: stage_pb2.StageInputs) -> None:
    """Upstream token ids become this stage's prompt as they are."""
    ids = list(inputs.token_ids)
    inputs.Clear()
    inputs.token_ids.extend(ids)


def _hidden_states_to_prompt_embeds(inputs: stage_pb2.StageInputs) -> None:
    """Upstream last-layer hidden states condition this stage as prompt embeddings."""
    hidden = [t for t in inputs.tensors if t.name == "hidden_states"]
    if not hidden:
        raise InvalidArgument(
            "inputs.tensors: transform hidden_states_to_prompt_embeds needs a "
            "'hidden_states' tensor from the upstream stage",
            field="inputs.tensors",
        )
    embeds = hidden[0]
    embeds.name = "prompt_embeds"
    inputs.Clear()
    inputs.tensors.append(embeds)


TRANSFORMS: dict[str, Callable[[stage_pb2.StageInputs], None]] = {
    "text": _text,
    "tokens": _tokens,
    "hidden_states_to_prompt_embeds": _hidden_states_to_prompt_embeds,
}


# What each transform needs the producing stage to emit (advertised in Describe).
NEEDS: dict[str, tuple[str, ...]] = {"hidden_states_to_prompt_embeds": ("hidden_states",)}


def describe() -> list[stage_pb2.TransformInfo]:
    return [
        stage_pb2.TransformInfo(
            name=name,
            needs_tensors=NEEDS.get(name, ()),
            description=(fn.__doc__ or "").strip(),
        )
        for name, fn in sorted(TRANSFORMS.items())
    ]


def apply_transform(submit: stage_pb2.Submit) -> None:
    """Rewrite ``submit.inputs`` in place by ``submit.transform`` ("" = as they are)."""
    if not submit.transform:
        return
    transform = TRANSFORMS.get(submit.transform)
    if transform is None:
        known = ", ".join(sorted(TRANSFORMS))
        raise InvalidArgument(
            f"submit.transform: unknown transform {submit.transform!r} (known: {known})",
            field="submit.transform",
        )
    transform(submit.inputs)
