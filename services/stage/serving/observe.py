"""What a stage reports to telemetry, per request: a span for the request under
the orchestrator's (its context comes in ``Submit.trace_context``), with
children for the time it queued, for the engine's compute and for each tensor
hand-off (transport and bytes); and its queue depth and running batch as
metrics. Every function returns at once when telemetry is off."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

from opentelemetry import trace

from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.telemetry import metrics, tracing


@contextlib.contextmanager
def request(stage: str, request_id: str, trace_context: Mapping[str, str]) -> Iterator[None]:
    if not tracing.ENABLED:
        yield
        return
    attributes = {"omni.stage": stage, "gen_ai.response.id": request_id}
    with tracing.context_of(trace_context):
        with tracing.tracer().start_as_current_span(
            f"stage {stage}", kind=trace.SpanKind.SERVER, attributes=attributes
        ):
            yield


@contextlib.contextmanager
def queued(stage: str) -> Iterator[None]:
    """Around the wait for a run slot: the queue depth, and a span for the wait."""
    if not tracing.ENABLED:
        yield
        return
    at = {"omni.stage": stage}
    metrics.QUEUE_DEPTH.add(1, at)
    began = time.time_ns()
    try:
        yield
    finally:
        metrics.QUEUE_DEPTH.add(-1, at)
        span = tracing.tracer().start_span("stage.queue", start_time=began, attributes=at)
        span.end()


@contextlib.contextmanager
def running(stage: str) -> Iterator[None]:
    """Around the engine's work on a request: the running batch, and a compute span."""
    if not tracing.ENABLED:
        yield
        return
    at = {"omni.stage": stage}
    metrics.RUNNING.add(1, at)
    try:
        with tracing.tracer().start_as_current_span("stage.compute", attributes=at):
            yield
    finally:
        metrics.RUNNING.add(-1, at)


def handed_off(stage: str, msg: tensor_pb2.Tensor, began_ns: int) -> None:
    """One output tensor encoded for its consumer: by which transport, how many bytes."""
    if not tracing.ENABLED:
        return
    transport = msg.WhichOneof("data") or "raw"
    nbytes = len(msg.raw) if transport == "raw" else getattr(msg, transport).nbytes
    attributes = {
        "omni.stage": stage,
        "omni.tensor": msg.name,
        "omni.transport": transport,
        "omni.tensor.bytes": nbytes,
    }
    span = tracing.tracer().start_span("stage.handoff", start_time=began_ns, attributes=attributes)
    span.end()
