"""A stage's output as its client gets it: under the client's own request id, and
without the hidden states an edge asked for (they are not the client's to see)."""

from __future__ import annotations

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2


def client_event(
    stage: str, output: stage_pb2.StageOutput, request_id: str, *, hidden: bool
) -> orchestrator_pb2.GenerateEvent:
    """``hidden``: whether the client itself asked this stage for hidden states (a
    thinker's hand-off to its talker names its prompt's "prompt_hidden_states")."""
    event = orchestrator_pb2.GenerateEvent(stage=stage)
    kind = output.WhichOneof("kind")
    message = getattr(event, kind)
    message.CopyFrom(getattr(output, kind))
    if kind in ("segment", "progress", "completed"):
        message.request_id = request_id
    if kind == "segment" and not hidden:
        tensors = message.tensors
        kept = [t for t in tensors if not t.name.endswith("hidden_states")]
        del tensors[:]
        tensors.extend(kept)
    return event
