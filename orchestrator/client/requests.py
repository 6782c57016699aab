"""A request as the Orchestrator service takes it: ``make_request`` for Generate,
``stream_inputs`` for GenerateStream (large media as chunks, then one Submit)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from orchestrator.client.content import fill
from services.mesh.data import media_wire
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2

Params = stage_pb2.GenerationParams | Mapping[str, Any] | None


def make_request(
    prompt: str | None = None,
    *,
    inputs: stage_pb2.StageInputs | None = None,
    params: Params = None,
    stage_params: Mapping[str, Params] | None = None,
    request_id: str = "",
    media: Sequence[stage_pb2.ContentPart] = (),
    stage: str = "",
    affinity_key: str = "",
    outputs: Sequence[str] = (),
) -> orchestrator_pb2.GenerateRequest:
    """A GenerateRequest; a plain prompt is sent as one user chat message, with
    ``media`` (orchestrator/client/content.py) as its first parts when given. ``stage``:
    run that stage alone (its inputs and ``params`` are the request's).
    ``affinity_key``: one conversation's (its stages with affinity keep it on one replica).
    ``outputs``: the pipeline outputs wanted (only the stages they need run; empty: all)."""
    request = orchestrator_pb2.GenerateRequest(
        request_id=request_id, stage=stage, affinity_key=affinity_key, outputs=outputs
    )
    if inputs is not None:
        request.inputs.CopyFrom(inputs)
    if prompt is not None or media:
        text = () if prompt is None else (prompt,)
        fill(request.inputs.messages.add(role="user"), *media, *text)
    if params:
        request.params.CopyFrom(_params(params))
    for stage, values in (stage_params or {}).items():
        request.stage_params[stage].CopyFrom(_params(values))
    return request


def stream_inputs(
    request: orchestrator_pb2.GenerateRequest,
) -> list[orchestrator_pb2.StreamInput]:
    """``request`` as GenerateStream messages: its large media as TensorChunks, then
    its one Submit (under a new id when it has none: a stream's Submit needs one).
    The media are moved out of ``request`` (it holds chunk refs after): copying
    them first would cost more than sending them."""
    chunks = [orchestrator_pb2.StreamInput(chunk=c) for c in media_wire.split(request.inputs)]
    last = orchestrator_pb2.StreamInput()
    submit = last.submit
    submit.request_id, submit.is_last = request.request_id or uuid.uuid4().hex, True
    submit.inputs.CopyFrom(request.inputs)
    submit.params.CopyFrom(request.params)
    for stage, params in request.stage_params.items():
        last.stage_params[stage].CopyFrom(params)
    last.affinity_key, last.stage = request.affinity_key, request.stage
    last.outputs.extend(request.outputs)
    return [*chunks, last]


def _params(values: Params) -> stage_pb2.GenerationParams:
    if isinstance(values, stage_pb2.GenerationParams):
        return values
    return json_format.ParseDict(dict(values or {}), stage_pb2.GenerationParams())
