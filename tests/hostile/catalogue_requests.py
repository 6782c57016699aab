"""The catalogue, per request: ownership and control, request ids and
windows, parameters out of range, inputs the model cannot take, and the
orchestrator's own checks."""

from __future__ import annotations

import math

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from tests.hostile.cases import (
    Case,
    cancel,
    chunk,
    chunked,
    embeds,
    orchestrator,
    stage,
    stream,
    submit,
    with_extra,
    with_trace,
)
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


def max_tokens_on_the_wire(value: int) -> stage_pb2.StageInput:
    """A Submit whose params.max_tokens varint is ``value``, whatever int32 can hold."""
    varint = bytearray()
    while True:
        varint.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            break
    params = b"\x08" + bytes(varint)
    body = submit().submit.SerializeToString() + b"\x1a" + bytes([len(params)]) + params
    return stage_pb2.StageInput.FromString(b"\x0a" + bytes([len(body)]) + body)


NAN = float("nan")
FLOATS_4x64 = bytes(4 * 64 * 4)

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
    # Parameters out of range.
    *[
        Case(
            f"{name} at {where}",
            send(submit(**{param: value})),
            "INVALID_ARGUMENT",
            f"params.{param}",
        )
        for where, send in (("stage", lambda s: stage([s])), ("orchestrator", orchestrator))
        for name, param, value in (
            ("temperature -1", "temperature", -1.0),
            ("temperature nan", "temperature", NAN),
            ("temperature inf", "temperature", math.inf),
            ("top_p 0", "top_p", 0.0),
            ("top_p nan", "top_p", NAN),
            ("top_k -1", "top_k", -1),
            ("max_tokens 0", "max_tokens", 0),
            ("max_tokens -1", "max_tokens", -1),
            ("max_tokens 2^31-1", "max_tokens", (1 << 31) - 1),
            ("seed -1 as uint64", "seed", (1 << 64) - 1),
            ("empty stop string", "stop", [""]),
            ("a parameter the engine lacks", "num_inference_steps", 4),
        )
    ],
    Case(
        "max_tokens 2^31 on the wire (an int32 field)",
        stage([max_tokens_on_the_wire(1 << 31)]),
        "INVALID_ARGUMENT",
        "params.max_tokens",
    ),
    Case(
        "unknown extra key",
        stage([with_extra(submit(), frobnicate=1)]),
        "INVALID_ARGUMENT",
        "params.extra.",
    ),
    Case(
        "NaN in params.extra",
        stage([with_extra(submit(), weight=math.nan)]),
        "INVALID_ARGUMENT",
        "params.extra",
    ),
    Case(
        "inf in params.extra at the orchestrator",
        orchestrator(with_extra(submit(), weight=math.inf)),
        "INVALID_ARGUMENT",
        "params.extra",
    ),
    # Inputs the model cannot take.
    Case("empty role", stage([submit(role="")]), "INVALID_ARGUMENT", "inputs.messages[0].role"),
    Case("unknown role", stage([submit(role="wizard")]), "OK", ""),
    Case("no input at all", stage([submit(prompt=None)]), "INVALID_ARGUMENT", "inputs"),
    Case(
        "two inputs at once",
        stage([submit(token_ids=[1, 2], tensors=[embeds([4, 64], FLOATS_4x64)])]),
        "INVALID_ARGUMENT",
        "inputs",
    ),
    Case(
        "token id past the vocabulary",
        stage([submit(token_ids=[1, 1 << 40])]),
        "INVALID_ARGUMENT",
        "inputs.token_ids",
    ),
    Case(
        "negative token id", stage([submit(token_ids=[-5])]), "INVALID_ARGUMENT", "inputs.token_ids"
    ),
    Case(
        "token id past the vocabulary at the orchestrator",
        orchestrator(submit(token_ids=[70_000])),
        "INVALID_ARGUMENT",
        "inputs.token_ids",
    ),
    Case(
        "embeddings of the wrong width",
        stage([submit(tensors=[embeds([4, 32], bytes(4 * 32 * 4))])]),
        "INVALID_ARGUMENT",
        "inputs.tensors.prompt_embeds",
    ),
    Case(
        "embeddings full of NaN",
        stage([submit(tensors=[embeds([4, 64], b"\xff\xff\xff\x7f" * 256)])]),
        "INVALID_ARGUMENT",
        "inputs.tensors.prompt_embeds",
    ),
    Case(
        "embeddings with inf, sampled",
        stage([submit(tensors=[embeds([4, 64], b"\x00\x00\x80\x7f" * 256)], temperature=1.0)]),
        "INVALID_ARGUMENT",
        "inputs.tensors.prompt_embeds",
    ),
    *[
        Case(
            f"embeddings as {dtype}",
            stage([submit(tensors=[embeds([4, 64], bytes(256 * size), dtype=dtype)])]),
            "OK",
            "",
        )
        for dtype, size in (("float64", 8), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1))
    ],
    Case(
        "embeddings as int32",
        stage([submit(tensors=[embeds([4, 64], bytes(1024), dtype="int32")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors.prompt_embeds",
    ),
    Case(
        "embeddings 0-dim",
        stage([submit(tensors=[embeds([], bytes(4))])]),
        "INVALID_ARGUMENT",
        "inputs.tensors.prompt_embeds",
    ),
    Case(
        "embeddings with no rows",
        stage([submit(tensors=[embeds([0, 64], b"")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors.prompt_embeds",
    ),
    Case("temperature 1e-40, sampled", stage([submit(temperature=1e-40, max_tokens=8)]), "OK", ""),
    Case("temperature 1e30", stage([submit(temperature=1e30, max_tokens=8)]), "OK", ""),
    Case("top_k 2^31-1", stage([submit(temperature=1.0, top_k=(1 << 31) - 1)]), "OK", ""),
    Case("top_p denormal", stage([submit(temperature=1.0, top_p=1e-45)]), "OK", ""),
    Case("seed 2^63-1", stage([submit(temperature=1.0, seed=(1 << 63) - 1)]), "OK", ""),
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
    Case(
        "stream ends before the last window at the orchestrator",
        stream([submit(last=False)]),
        "INVALID_ARGUMENT",
        "submit.is_last",
    ),
    Case(
        "stage_params for the entry stage",
        orchestrator(submit(), thinker=stage_pb2.GenerationParams(max_tokens=2)),
        "OK",
        "",
    ),
    Case(
        "unknown extra key at the orchestrator",
        orchestrator(with_extra(submit(), frobnicate=1)),
        "INVALID_ARGUMENT",
        "params.extra.frobnicate",
    ),
    Case(
        "dims overflow int64 at the orchestrator",
        orchestrator(submit(tensors=[embeds([1 << 62, 64])])),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shape",
    ),
    Case(
        "chunked ref in a unary request",
        orchestrator(submit(tensors=[chunked("c8", 4)])),
        "INVALID_ARGUMENT",
        "inputs.tensors[0]",
    ),
    Case(
        "chunk out of order at the orchestrator",
        stream([chunk("c9", 7, b"abc", 10)], rid=""),
        "INVALID_ARGUMENT",
        "chunk",
    ),
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
    Case(
        "role of 10 KB",
        stage([submit(role="r" * 10_240)]),
        "INVALID_ARGUMENT",
        "inputs.messages",  # its 5,000 tokens pass max_prompt_tokens
    ),
    Case(
        "NUL and control characters in content", stage([submit(prompt="a\0b\x1b[2J\r")]), "OK", ""
    ),
    Case(
        "two thousand stop strings",
        stage([submit(stop=[f"never-{i}-" * 20 for i in range(2000)])]),
        "OK",
        "",
    ),
    # The orchestrator's own checks.
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
