"""What the requests side reports to telemetry: one trace per request (a root
span, a span per stage it reaches, a span per window forwarded on an edge) and
the metrics operators watch. Every function returns at once when telemetry is
off (``services.mesh.telemetry.tracing``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace

from orchestrator.server.requests.audio_clock import AudioClock
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.telemetry import metrics, tracing

_NO_SPAN = contextlib.nullcontext()


def request_span(request_id: str) -> contextlib.AbstractContextManager[Any]:
    if not tracing.ENABLED:
        return _NO_SPAN
    return tracing.tracer().start_as_current_span(
        "omni.request",
        kind=trace.SpanKind.SERVER,
        attributes={"gen_ai.operation.name": "generate", "gen_ai.response.id": request_id},
    )


def stage_span(request_id: str, stage: str) -> contextlib.AbstractContextManager[Any]:
    """The orchestrator's span of one stage's part in a request; its context is what
    the stage's own spans hang under (``Submit.trace_context``)."""
    if not tracing.ENABLED:
        return _NO_SPAN
    return tracing.tracer().start_as_current_span(
        f"omni.stage {stage}",
        kind=trace.SpanKind.CLIENT,
        attributes={"omni.stage": stage, "gen_ai.response.id": request_id},
    )


@contextlib.contextmanager
def window_span(edge: str, submit: stage_pb2.Submit) -> Iterator[None]:
    """From a window's Submit being built until it is written to the stage."""
    if not tracing.ENABLED:
        yield
        return
    metrics.WINDOWS.add(1, {"omni.edge": edge})
    inputs = submit.inputs
    attributes: dict[str, str | int | bool] = {
        "omni.edge": edge,
        "omni.window.sequence": submit.sequence,
        "omni.window.is_last": submit.is_last,
        "omni.window.items": len(inputs.token_ids) or len(inputs.tensors),
    }
    with tracing.tracer().start_as_current_span(f"omni.window {edge}", attributes=attributes):
        yield


def outputs(stage: str, output: stage_pb2.StageOutput) -> None:
    """A stage's event as the orchestrator reads it: tensor bytes by transport,
    and a stage's timings and token counts from its Completed."""
    if not tracing.ENABLED:
        return
    kind = output.WhichOneof("kind")
    if kind == "segment":
        for tensor in output.segment.tensors:
            transport = tensor.WhichOneof("data") or "raw"
            nbytes = len(tensor.raw) if transport == "raw" else getattr(tensor, transport).nbytes
            metrics.TENSOR_BYTES.add(nbytes, {"omni.stage": stage, "omni.transport": transport})
    elif kind == "completed":
        _completed(stage, output.completed)


def _completed(stage: str, completed: stage_pb2.Completed) -> None:
    at = {"omni.stage": stage}
    timings, usage = completed.timings, completed.usage
    metrics.STAGE_REQUEST_DURATION.record(timings.total_ms / 1e3, at)
    if usage.completion_tokens:
        metrics.TIME_TO_FIRST_TOKEN.record(timings.time_to_first_ms / 1e3, at)
    if usage.completion_tokens > 1:
        per_token = (timings.total_ms - timings.time_to_first_ms) / (usage.completion_tokens - 1)
        metrics.TIME_PER_OUTPUT_TOKEN.record(per_token / 1e3, at)
    metrics.TOKENS.add(usage.prompt_tokens, {**at, "gen_ai.token.type": "input"})
    metrics.TOKENS.add(usage.completion_tokens, {**at, "gen_ai.token.type": "output"})
    span = trace.get_current_span()
    span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)


def spoken(audio: AudioClock) -> None:
    """A request's audio at its client, per output stage that spoke."""
    if not tracing.ENABLED:
        return
    for stage, stream in audio.streams.items():
        at = {"omni.stage": stage}
        metrics.TIME_TO_FIRST_AUDIO.record(stream.first_s, at)
        metrics.REAL_TIME_FACTOR.record(audio.real_time_factor(stage), at)
        if stream.underruns:
            metrics.UNDERRUNS.add(stream.underruns, at)


def finished(done: orchestrator_pb2.Done, blocked_s: dict[str, float]) -> None:
    """A request's Done: its status, duration and the time its edges were held back."""
    if not tracing.ENABLED:
        return
    status = done.code_name or "OK"
    metrics.REQUEST_DURATION.record(done.total_ms / 1e3, {"omni.status": status})
    metrics.REQUESTS.add(1, {"omni.status": status, "omni.stage": done.stage})
    for edge, seconds in blocked_s.items():
        if seconds:
            metrics.BLOCKED.add(seconds, {"omni.edge": edge})
    span = trace.get_current_span()
    if done.code:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{status}: {done.message}"))
        span.set_attribute("omni.status", status)
        if done.stage:
            span.set_attribute("omni.failed_stage", done.stage)
