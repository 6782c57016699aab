"""The catalogue, per request's content: parameters out of range or at their
edges, and inputs the model cannot take."""

from __future__ import annotations

import math

from services.mesh.pb.omni.v1 import stage_pb2
from tests.hostile.cases import (
    Case,
    chunk,
    chunked,
    embeds,
    orchestrator,
    stage,
    stream,
    submit,
    with_extra,
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

INPUTS = [
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
    Case(
        "unknown extra key at the orchestrator",
        orchestrator(with_extra(submit(), frobnicate=1)),
        "INVALID_ARGUMENT",
        "params.extra.frobnicate",
    ),
    # Parameters at their edges.
    Case("temperature 1e-40, sampled", stage([submit(temperature=1e-40, max_tokens=8)]), "OK", ""),
    Case("temperature 1e30", stage([submit(temperature=1e30, max_tokens=8)]), "OK", ""),
    Case("top_k 2^31-1", stage([submit(temperature=1.0, top_k=(1 << 31) - 1)]), "OK", ""),
    Case("top_p denormal", stage([submit(temperature=1.0, top_p=1e-45)]), "OK", ""),
    Case("seed 2^63-1", stage([submit(temperature=1.0, seed=(1 << 63) - 1)]), "OK", ""),
    Case(
        "two thousand stop strings",
        stage([submit(stop=[f"never-{i}-" * 20 for i in range(2000)])]),
        "OK",
        "",
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
]
