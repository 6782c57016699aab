"""proto -> domain for the Stage service: where a Submit is read (its fields,
its size, its parameters). Input tensors are decoded and joined in ``inputs.py``;
outputs are written in ``outputs.py``; engine-specific checks (prompt length,
ranges) live in the engines."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from services.engines.base import EngineRequest, SamplingParams
from services.mesh.errors import InvalidArgument, ResourceExhausted
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.stage.config import Runtime
from services.stage.serving.inputs import Inputs

_SCALAR_PARAMS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "return_hidden_states",
    "num_inference_steps",
    "guidance_scale",
    "height",
    "width",
    "preview_every",
    "return_png",
)


@dataclass(frozen=True)
class SubmitIn:
    """One Submit as the stage reads it: a window of a request's input and, on
    the request's first, how the request runs."""

    request_id: str
    sequence: int
    is_last: bool
    input_ended: bool  # a half-close of the request's input: nothing else in it counts
    inputs: stage_pb2.StageInputs  # decoded by inputs.decode (tensors in a thread)
    params: stage_pb2.GenerationParams  # read by sampling_params where a window's count
    transform: str
    consumer: tensor_pb2.NodeIdentity | None  # where its output tensors will be opened
    trace_context: dict[str, str]
    credit: int  # 0: no per-request flow control
    timeout_ms: int  # 0: no deadline


def read_submit(submit: stage_pb2.Submit) -> SubmitIn:
    return SubmitIn(
        request_id=submit.request_id,
        sequence=submit.sequence,
        is_last=submit.is_last,
        input_ended=submit.input_ended,
        inputs=submit.inputs,
        params=submit.params,
        transform=submit.transform,
        consumer=submit.consumer if submit.HasField("consumer") else None,
        trace_context=dict(submit.trace_context),
        credit=submit.credit,
        timeout_ms=submit.timeout_ms,
    )


def check_submit(submit: stage_pb2.Submit, limits: Runtime) -> None:
    """Before any of a Submit is used: its size, its count of token ids, and no
    field this stage does not know."""
    _check_size(submit, limits.max_message_bytes)
    _check_token_count(submit, limits.max_prompt_tokens)
    _refuse_unknown_fields(submit, "submit")


def _check_size(submit: stage_pb2.Submit, limit: int) -> None:
    size = submit.ByteSize()
    if size > limit:
        raise ResourceExhausted(
            f"submit: message is {size} bytes, the stage accepts at most {limit} "
            "(runtime.max_message_bytes)",
            field="submit",
        )


def _check_token_count(submit: stage_pb2.Submit, limit: int) -> None:
    """Refuse more token ids in one Submit than any prompt may have, before they are
    turned into Python ints (36 bytes each: 64 MiB of ids would take gigabytes)."""
    count = len(submit.inputs.token_ids)
    if count > limit:
        raise InvalidArgument(
            f"inputs.token_ids: {count} ids, the limit is {limit} (runtime.max_prompt_tokens)",
            field="inputs.token_ids",
        )


def _refuse_unknown_fields(msg: Message, field: str) -> None:
    # A client built from a newer contract may set fields this stage does not
    # know; silently ignoring a parameter would change results without a word.
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise InvalidArgument(f"{field}: unknown field number(s) {numbers}", field=field)


def sampling_params(
    params: stage_pb2.GenerationParams, supported: frozenset[str], engine: str
) -> SamplingParams:
    """GenerationParams -> SamplingParams, refusing anything the engine does not honour."""
    _refuse_unknown_fields(params, "params")
    values: dict[str, object] = {}
    for name in _SCALAR_PARAMS:
        if params.HasField(name):
            values[name] = getattr(params, name)
    if params.stop:
        values["stop"] = tuple(params.stop)
    extra = _extra(params) if params.HasField("extra") else {}
    asked = [*values, *(f"extra.{key}" for key in extra)]
    refused = [name for name in asked if name not in supported]
    if refused:
        field = f"params.{refused[0]}"
        raise InvalidArgument(
            f"{field}: not supported by the {engine} engine "
            f"(supported: {', '.join(sorted(supported))})",
            field=field,
        )
    return SamplingParams(**values, extra=extra)  # type: ignore[arg-type]


def _extra(params: stage_pb2.GenerationParams) -> dict[str, object]:
    try:
        return json_format.MessageToDict(params.extra)
    except ValueError as exc:  # NaN or inf numbers, a Value with no kind: no JSON for them
        raise InvalidArgument(
            f"params.extra: expected JSON values ({exc})", field="params.extra"
        ) from None


def engine_request(request_id: str, inputs: Inputs, params: SamplingParams) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        text=inputs.text or None,
        messages=inputs.messages,
        turns=inputs.turns,
        token_ids=inputs.token_ids,
        tensors=inputs.tensors,
        params=params,
    )
