"""Input processors a consuming stage applies to what an upstream stage produced
(named by the pipeline edge's ``transform``, carried in ``Submit.transform``).

They act on decoded, whole inputs (``inputs.Inputs``: every piece of a tensor
already joined), before engine validation, so an engine sees an ordinary
request: a prompt, token ids, or prompt embeddings. The stage advertises them,
with the tensors each needs from its producer, in ``Describe``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2
from services.stage.serving.inputs import Inputs


@dataclass(frozen=True)
class Transform:
    name: str
    description: str
    apply: Callable[[Inputs], Inputs]
    # Output tensors the producing stage must emit for this transform.
    needs_tensors: tuple[str, ...] = ()

    def info(self) -> stage_pb2.TransformInfo:
        return stage_pb2.TransformInfo(
            name=self.name, needs_tensors=list(self.needs_tensors), description=self.description
        )


def _text(inputs: Inputs) -> Inputs:
    return Inputs(messages=(("user", inputs.text),))


def _tokens(inputs: Inputs) -> Inputs:
    return Inputs(token_ids=inputs.token_ids)


def _hidden_states_to_prompt_embeds(inputs: Inputs) -> Inputs:
    hidden = inputs.tensors.get("hidden_states")
    if hidden is None:
        raise InvalidArgument(
            "inputs.tensors: transform hidden_states_to_prompt_embeds needs a "
            "'hidden_states' tensor from the upstream stage",
            field="inputs.tensors",
        )
    return Inputs(tensors={"prompt_embeds": hidden})


TRANSFORMS: dict[str, Transform] = {
    t.name: t
    for t in (
        Transform("text", "upstream text becomes this stage's prompt, as a user message", _text),
        Transform("tokens", "upstream token ids become this stage's prompt as they are", _tokens),
        Transform(
            "hidden_states_to_prompt_embeds",
            "upstream last-layer hidden states (one row per generated token) condition this "
            "stage as prompt embeddings",
            _hidden_states_to_prompt_embeds,
            needs_tensors=("hidden_states",),
        ),
    )
}


def check_transform(name: str) -> None:
    """Refuse an unknown transform name ("" = none)."""
    if name and name not in TRANSFORMS:
        known = ", ".join(sorted(TRANSFORMS))
        raise InvalidArgument(
            f"submit.transform: unknown transform {name!r} (known: {known})",
            field="submit.transform",
        )


def apply_transform(name: str, inputs: Inputs) -> Inputs:
    """``inputs`` processed by transform ``name`` ("" = as they are)."""
    check_transform(name)
    return TRANSFORMS[name].apply(inputs) if name else inputs
