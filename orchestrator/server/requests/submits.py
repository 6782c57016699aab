"""The Submits one request sends one stage: built, and completed for the wire, here.

A stage's Submits are the client's own (the entry stage: ``from_client`` for a
Generate, or the windows of a GenerateStream) or the windows of its incoming
edge (``from_window``). On its way out every one gets what the orchestrator
adds (``StageSubmits.outgoing``): the params the consumers' transforms need,
the consuming stage's node when tensors may go to it by ref, and the trace
context; the first one also the request's credit on the shared stream and what
is left of the client's deadline. A request whose input stops before its last
window ends it with ``input_ended``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.server.requests.request_stream import CREDIT
from orchestrator.server.requests.windows import Window
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2, tensor_pb2
from services.mesh.telemetry import tracing


def from_client(request_id: str, request: orchestrator_pb2.GenerateRequest) -> stage_pb2.Submit:
    """A Generate's one Submit to the entry stage: the whole input at once. Copied
    with CopyFrom: the constructor re-encodes a sub-message (upb), many times slower
    for megabytes of tensor or media bytes (docs/benchmarks.md)."""
    submit = stage_pb2.Submit(request_id=request_id, is_last=True)
    submit.inputs.CopyFrom(request.inputs)
    submit.params.CopyFrom(request.params)
    return submit


def from_window(
    request_id: str,
    window: Window,
    transform: str,
    params: stage_pb2.GenerationParams | None,
) -> stage_pb2.Submit:
    """An edge's window as the Submit its consuming stage is sent (``params``: the
    client's for that stage, if it gave any)."""
    submit = stage_pb2.Submit(
        request_id=request_id,
        sequence=window.sequence,
        is_last=window.is_last,
        transform=transform,
    )
    submit.inputs.text = window.text
    submit.inputs.token_ids.extend(window.token_ids)
    submit.inputs.tensors.extend(window.tensors)
    if params is not None:
        submit.params.CopyFrom(params)
    return submit


@dataclass
class StageSubmits:
    """What the orchestrator adds to every Submit of one request to one stage."""

    request_id: str  # the stage id (RequestFlow.stage_id)
    asks: frozenset[str] = frozenset()  # GenerationParams flags the consumers need set
    consumer: tensor_pb2.NodeIdentity | None = None  # one consumer that may open refs
    deadline: float | None = None  # the client's, in time.monotonic()
    sent: int = 0  # Submits completed so far

    def outgoing(self, submit: stage_pb2.Submit) -> stage_pb2.Submit:
        """``submit`` completed for the wire (in place): call it once per Submit, in
        order, before the window's own span opens, so that the stage's spans hang
        under the orchestrator's span of that stage and not under a window's. It
        goes under the request's stage id, whatever id the client gave it."""
        submit.request_id = self.request_id
        for param in sorted(self.asks):
            setattr(submit.params, param, True)
        if self.consumer is not None:
            submit.consumer.CopyFrom(self.consumer)
        tracing.inject_into(submit.trace_context)
        if not self.sent:
            submit.credit = CREDIT
            if self.deadline is not None:  # what is left of it, for the stage
                submit.timeout_ms = max(int((self.deadline - time.monotonic()) * 1e3), 1)
        self.sent += 1
        return submit

    def input_ended(self) -> stage_pb2.Submit:
        """The client stopped before its last window: no more input for this request."""
        return stage_pb2.Submit(request_id=self.request_id, input_ended=True)
