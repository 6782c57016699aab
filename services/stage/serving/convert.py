"""proto <-> domain for the Stage service: request ids, sizes, parameters and
outputs. Input tensors are decoded and joined in ``inputs.py``; engine-specific
checks (prompt length, ranges) live in the engines."""

from __future__ import annotations

from collections.abc import Callable

import torch
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from services.engines.base import EngineRequest, SamplingParams
from services.mesh.errors import InvalidArgument, OmniError, ResourceExhausted, wire_error
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.tensors import codec
from services.stage.serving.events import CompletedOut, ProgressOut, SegmentOut, StageEvent
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


def check_size(submit: stage_pb2.Submit, limit: int) -> None:
    size = submit.ByteSize()
    if size > limit:
        raise ResourceExhausted(
            f"submit: message is {size} bytes, the stage accepts at most {limit} "
            "(runtime.max_message_bytes)",
            field="submit",
        )


def check_token_count(submit: stage_pb2.Submit, limit: int) -> None:
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


def refuse_unknown_fields(submit: stage_pb2.Submit) -> None:
    _refuse_unknown_fields(submit, "submit")


def engine_request(request_id: str, inputs: Inputs, params: SamplingParams) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        text=inputs.text or None,
        messages=inputs.messages,
        token_ids=inputs.token_ids,
        tensors=inputs.tensors,
        params=params,
    )


def error_output(request_id: str, error: OmniError) -> stage_pb2.StageOutput:
    return stage_pb2.StageOutput(error=wire_error(request_id, error))


Encode = Callable[[torch.Tensor, str], tensor_pb2.Tensor]


def to_output(event: StageEvent, encode: Encode = codec.to_proto) -> stage_pb2.StageOutput:
    """The wire form of ``event``; ``encode`` picks each output tensor's transport."""
    if isinstance(event, SegmentOut):
        seg = event.segment
        return stage_pb2.StageOutput(
            segment=stage_pb2.Segment(
                request_id=event.request_id,
                sequence=seg.sequence,
                is_last=seg.is_last,
                token_ids=seg.token_ids,
                text_delta=seg.text,
                tensors=[encode(t, name) for name, t in seg.tensors.items()],
                blobs=[
                    tensor_pb2.Blob(name=b.name, media_type=b.media_type, data=b.data)
                    for b in seg.blobs
                ],
            )
        )
    if isinstance(event, ProgressOut):
        p = event.progress
        out = stage_pb2.Progress(
            request_id=event.request_id, step=p.step, total_steps=p.total_steps
        )
        if p.preview is not None:
            out.preview.CopyFrom(codec.to_proto(p.preview, "preview"))
        return stage_pb2.StageOutput(progress=out)
    if isinstance(event, CompletedOut):
        return stage_pb2.StageOutput(
            completed=stage_pb2.Completed(
                request_id=event.request_id,
                finish_reason=event.finish_reason,
                usage=stage_pb2.Usage(
                    prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                ),
                timings=stage_pb2.Timings(
                    queue_ms=event.queue_ms,
                    time_to_first_ms=event.time_to_first_ms,
                    total_ms=event.total_ms,
                ),
            )
        )
    return error_output(event.request_id, event.error)
