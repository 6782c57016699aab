"""The catalogue, per request: ownership and control, request ids and windows,
trace context, and the orchestrator's own checks. What a request carries
(parameters, inputs) is in catalogue_inputs.py."""

from __future__ import annotations

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from tests.hostile.cases import Case, cancel, orchestrator, stage, stream, submit, with_trace
from tests.hostile.control_plane import (
    abort_huge_ids,
    abort_unknown_at_orchestrator,
    alice_pauses,
    bob_aborts_alices_request,
    bob_cancels_alices_request,
    bob_reuses_alices_request_id,
    stranger_aborts_at_the_stage,
)
from tests.hostile.senders import (
    LONG,
    Running,
    at_orchestrator,
)

REQUESTS = [
    # Ownership and control.
    Case("abort another caller's request", bob_aborts_alices_request, "NOT_FOUND", ""),
    Case(
        "cancel another caller's request",
        bob_cancels_alices_request,
        "NOT_FOUND",
        "cancel.request_id",
    ),
    Case("abort at a stage as a stranger", stranger_aborts_at_the_stage, "UNAUTHENTICATED", ""),
    Case("pause without an admin token", alice_pauses, "PERMISSION_DENIED", "PauseGeneration"),
    Case("abort unknown ids at the orchestrator", abort_unknown_at_orchestrator, "NOT_FOUND", ""),
    Case(
        "generate without a token",
        lambda mesh: at_orchestrator(mesh, orchestrator_pb2.GenerateRequest(), who=None),
        "UNAUTHENTICATED",
        "",
    ),
    Case(
        "cancel of an unknown id",
        stage([cancel("nobody")], rid="nobody"),
        "NOT_FOUND",
        "cancel.request_id",
    ),
    Case(
        "cancel of an unknown id at the orchestrator",
        stream([cancel("nobody")], rid="nobody"),
        "NOT_FOUND",
        "cancel.request_id",
    ),
    Case(
        "another caller's request id in flight",
        lambda mesh: bob_reuses_alices_request_id(mesh, on_stream=False),
        "OK",
        "",
    ),
    Case(
        "another caller's request id in flight, on a stream",
        lambda mesh: bob_reuses_alices_request_id(mesh, on_stream=True),
        "OK",
        "",
    ),
    Case("abort and release ids of 10 KB", abort_huge_ids, "INVALID_ARGUMENT", "request_ids[0]"),
    # Request ids and windows.
    Case(
        "duplicate submit id",
        stage([submit(max_tokens=LONG), Running("h"), submit()]),
        "INVALID_ARGUMENT",
        "submit.request_id",
    ),
    Case(
        "window after is_last",
        stage([submit(max_tokens=LONG), Running("h"), submit(seq=1)]),
        "INVALID_ARGUMENT",
        "submit.sequence",
    ),
    Case(
        "windows out of order",
        stage([submit(last=False), submit(seq=2)]),
        "INVALID_ARGUMENT",
        "submit.sequence",
    ),
    Case("first window not 0", stage([submit(seq=3)]), "INVALID_ARGUMENT", "submit.sequence"),
    Case(
        "stream ends before the last window",
        stage([submit(last=False)]),
        "INVALID_ARGUMENT",
        "submit.is_last",
    ),
    Case(
        "window after is_last at the orchestrator",
        stream([submit(max_tokens=LONG), Running("h"), submit(seq=1)]),
        "INVALID_ARGUMENT",
        "submit.request_id",
    ),
    Case(
        "windows out of order at the orchestrator",
        stream([submit(last=False), submit(seq=2)]),
        "INVALID_ARGUMENT",
        "submit.sequence",
    ),
    Case("empty request_id", stage([submit("")], rid=""), "INVALID_ARGUMENT", "submit.request_id"),
    Case(
        "empty request_id at the orchestrator stream",
        stream([submit("")], rid=""),
        "INVALID_ARGUMENT",
        "submit.request_id",
    ),
    Case(
        "request_id of 10 KB",
        stage([submit("r" * 10_240)], rid="r" * 10_240),
        "INVALID_ARGUMENT",
        "submit.request_id",
    ),
    Case(
        "request_id of 10 KB at the orchestrator",
        orchestrator(submit("r" * 10_240)),
        "INVALID_ARGUMENT",
        "request_id",
    ),
    Case(
        "request_id with control characters",
        stage([submit("a\nb\0")], rid="a\nb\0"),
        "INVALID_ARGUMENT",
        "submit.request_id",
    ),
    Case(
        "unknown transform",
        stage([submit(transform="rot13")]),
        "INVALID_ARGUMENT",
        "submit.transform",
    ),
    Case(
        "stream ends before the last window at the orchestrator",
        stream([submit(last=False)]),
        "INVALID_ARGUMENT",
        "submit.is_last",
    ),
    # Trace context.
    Case(
        "garbage trace context",
        stage([with_trace(submit(), traceparent="zz-" * 3000, tracestate="\0\n" * 100)]),
        "OK",
        "",
    ),
    Case(
        "garbage trace context at the orchestrator stream",
        stream([with_trace(submit(), traceparent="00-" + "f" * 32 + "-" + "0" * 16 + "-01")]),
        "OK",
        "",
    ),
    # The orchestrator's own checks.
    Case(
        "stage_params for the entry stage",
        orchestrator(submit(), thinker=stage_pb2.GenerationParams(max_tokens=2)),
        "OK",
        "",
    ),
    Case(
        "stage_params for a stage that does not exist",
        orchestrator(submit(), nope=stage_pb2.GenerationParams()),
        "INVALID_ARGUMENT",
        "stage_params.nope",
    ),
    Case(
        "stage_params with a path-like stage name",
        orchestrator(submit(), **{"../thinker": stage_pb2.GenerationParams()}),
        "INVALID_ARGUMENT",
        "stage_params.",
    ),
]
