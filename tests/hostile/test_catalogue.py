"""The catalogue of hostile inputs: each case sends one kind of bad (or foreign)
input to a real stage or orchestrator and names the status and field it must
get. While it runs, an ordinary request on the same server (and one on the same
stream) completes with every token, and afterwards both servers answer health
SERVING. A case that gets UNKNOWN, INTERNAL, a Python class name, a hang, or
hurts another request is a product bug: fix the product, keep the case."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2, tensor_pb2
from services.mesh.shm_refs import SECRET_HEX
from tests.hostile.conftest import Mesh
from tests.hostile.senders import (
    LONG,
    Outcome,
    Running,
    at_orchestrator,
    on_orchestrator_stream,
    on_stage,
    raw_frames,
)

Send = Callable[[Mesh], Awaitable[Outcome]]


@dataclass(frozen=True)
class Case:
    name: str
    send: Send
    code: str  # the status the hostile request (or RPC) must get
    field: str  # must be in the outcome's field (in-band) or details (RPC status)


# --- building inputs --------------------------------------------------------------


def submit(
    rid: str = "h",
    *,
    prompt: str | None = "Hello",
    seq: int = 0,
    last: bool = True,
    tensors: Sequence[tensor_pb2.Tensor] = (),
    token_ids: Sequence[int] = (),
    role: str = "user",
    transform: str = "",
    **params: Any,
) -> stage_pb2.StageInput:
    message = stage_pb2.Submit(request_id=rid, sequence=seq, is_last=last, transform=transform)
    if prompt is not None and not tensors and not token_ids:
        message.inputs.messages.add(role=role, content=prompt)
    message.inputs.token_ids.extend(token_ids)
    message.inputs.tensors.extend(tensors)
    for key, value in {"max_tokens": 4, "temperature": 0.0, **params}.items():
        if isinstance(value, list):
            getattr(message.params, key).extend(value)
        else:
            setattr(message.params, key, value)
    return stage_pb2.StageInput(submit=message)


def embeds(shape: Sequence[int], raw: bytes | None = None, **kw: Any) -> tensor_pb2.Tensor:
    """A prompt_embeds tensor ([seq, 64] float32 is what the tiny model takes)."""
    tensor = tensor_pb2.Tensor(name="prompt_embeds", dtype=kw.pop("dtype", "float32"), shape=shape)
    if raw is not None:
        tensor.raw = raw
    for key, value in kw.items():
        getattr(tensor, key).CopyFrom(value)
    return tensor


def chunk(chunk_id: str, offset: int, data: bytes, total: int) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(
        chunk=tensor_pb2.TensorChunk(chunk_id=chunk_id, offset=offset, data=data, total=total)
    )


def chunked(chunk_id: str, rows: int) -> tensor_pb2.Tensor:
    return embeds([rows, 64], chunked=tensor_pb2.ChunkRef(chunk_id=chunk_id, nbytes=rows * 256))


def cancel(rid: str) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(cancel=stage_pb2.Cancel(request_id=rid))


def streamed(message: stage_pb2.StageInput | Running) -> orchestrator_pb2.StreamInput | Running:
    """The same message on the orchestrator's GenerateStream (field numbers agree)."""
    if isinstance(message, Running):
        return message
    return orchestrator_pb2.StreamInput.FromString(message.SerializeToString())


def victim(mesh: Mesh, **ref: Any) -> tensor_pb2.Tensor:
    """Request "victim"'s shared block, as prompt_embeds, its ref changed by ``ref``."""
    tensor = tensor_pb2.Tensor()
    tensor.CopyFrom(mesh.victim)
    tensor.name = "prompt_embeds"
    for key, value in ref.items():
        setattr(tensor.shm, key, value)
    return tensor


def guessed(mesh: Mesh) -> str:
    """The victim's block name with the secret guessed: pid and counter are public."""
    return mesh.victim.shm.name[:-SECRET_HEX] + "0" * SECRET_HEX


def foreign(tensor: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """``tensor`` with its ref claiming a producer on another machine."""
    tensor.shm.producer.boot_id = "another-machine"
    tensor.shm.producer.ipc_namespace = "ipc:[1]"
    return tensor


def with_extra(message: stage_pb2.StageInput, **extra: Any) -> stage_pb2.StageInput:
    message.submit.params.extra.update(extra)
    return message


# --- how each is sent -------------------------------------------------------------


def stage(
    build: Callable[[Mesh], Sequence[stage_pb2.StageInput | Running]]
    | Sequence[stage_pb2.StageInput | Running],
    rid: str = "h",
    who: str | None = "mesh",
) -> Send:
    def send(mesh: Mesh) -> Awaitable[Outcome]:
        messages = build(mesh) if callable(build) else build
        return on_stage(mesh, messages, rid, who=who)

    return send


def stream(messages: Sequence[stage_pb2.StageInput | Running], rid: str = "h") -> Send:
    return lambda mesh: on_orchestrator_stream(mesh, [streamed(m) for m in messages], rid)


def orchestrator(
    build: Callable[[Mesh], orchestrator_pb2.GenerateRequest] | stage_pb2.StageInput,
    **stage_params: stage_pb2.GenerationParams,
) -> Send:
    def send(mesh: Mesh) -> Awaitable[Outcome]:
        if callable(build):
            request = build(mesh)
        else:
            s = build.submit
            request = orchestrator_pb2.GenerateRequest(
                request_id=s.request_id, inputs=s.inputs, params=s.params
            )
            for name, params in stage_params.items():
                request.stage_params[name].CopyFrom(params)
        return at_orchestrator(mesh, request)

    return send


def frames(method: str, *frames_: bytes) -> Send:
    return lambda mesh: raw_frames(mesh, method, frames_)


def orchestrator_request(
    mesh: Mesh, *tensors: tensor_pb2.Tensor
) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(request_id="h")
    request.inputs.tensors.extend(tensors)
    return request


# --- control-plane cases ------------------------------------------------------------


async def bob_aborts_alices_request(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice, mesh.client("bob") as bob:
        events = aiter(
            alice.generate("Tell a long story.", request_id="alice-1", params={"max_tokens": LONG})
        )
        tokens = len((await anext(events)).segment.token_ids)
        reply = await bob.abort("alice-1")
        rest = [event async for event in events]
    tokens += sum(len(e.segment.token_ids) for e in rest)
    assert rest[-1].done.code_name == "OK" and tokens == LONG, "bob's abort reached alice"
    return Outcome("NOT_FOUND" if list(reply.not_found) == ["alice-1"] else "ABORTED", "")


async def bob_cancels_alices_request(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice:
        events = aiter(
            alice.generate("Tell a long story.", request_id="alice-2", params={"max_tokens": LONG})
        )
        await anext(events)
        outcome = await on_orchestrator_stream(
            mesh, [streamed(cancel("alice-2"))], "alice-2", who="bob"
        )
        rest = [event async for event in events]
    assert rest[-1].done.code_name == "OK", "bob's cancel reached alice"
    return outcome


async def stranger_releases_the_victims_block(mesh: Mesh) -> Outcome:
    async with mesh.stage(None) as stranger:
        try:
            await stranger.release_tensors(
                stage_pb2.ReleaseTensorsRequest(request_id="victim", names=[mesh.victim.shm.name])
            )
        except grpc.aio.AioRpcError as exc:
            outcome = Outcome(exc.code().name, exc.details() or "")
    # The block is still there for the mesh: the victim's data opens.
    assert await on_stage(mesh, [submit("reader", tensors=[victim(mesh)])], "reader") == Outcome(
        "OK", ""
    )
    return outcome


async def mesh_releases_guessed_names(mesh: Mesh) -> Outcome:
    names = [guessed(mesh), "../../etc/passwd", mesh.victim.shm.name + "/../x", ""]
    async with mesh.stage() as stage_client:
        reply = await stage_client.release_tensors(stage_pb2.ReleaseTensorsRequest(names=names))
    assert reply.released == 0
    assert await on_stage(mesh, [submit("reader", tensors=[victim(mesh)])], "reader") == Outcome(
        "OK", ""
    )
    return Outcome("OK", "")


async def stranger_aborts_at_the_stage(mesh: Mesh) -> Outcome:
    async with mesh.stage(None) as stranger:
        try:
            await stranger.abort("victim")
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "")
    return Outcome("OK", "")


async def alice_pauses(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice:
        try:
            await alice.pause()
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "")
    return Outcome("OK", "")


async def abort_unknown_at_orchestrator(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice:
        reply = await alice.abort("nobody", "")
    assert list(reply.not_found) == ["nobody", ""]
    return Outcome("NOT_FOUND", "")


# --- the catalogue -------------------------------------------------------------------

GENERATE = "/omni.v1.Stage/Generate"
VALID = submit("cut").SerializeToString()
NAN = float("nan")
FLOATS_4x64 = bytes(4 * 64 * 4)

CATALOGUE = [
    # Frames that are no StageInput end the RPC (its other requests with it): INVALID_ARGUMENT.
    Case("garbage frame", frames(GENERATE, b"\xff\xff\xff\xff"), "INVALID_ARGUMENT", "StageInput"),
    Case("truncated protobuf", frames(GENERATE, VALID[:-3]), "INVALID_ARGUMENT", "StageInput"),
    Case(
        "bad utf-8 in request_id",
        frames(GENERATE, VALID.replace(b"cut", b"\xff\xfe\xfd")),
        "INVALID_ARGUMENT",
        "StageInput",
    ),
    Case(
        "garbage frame at orchestrator stream",
        frames("/omni.v1.Orchestrator/GenerateStream", b"\xff\xff"),
        "INVALID_ARGUMENT",
        "StreamInput",
    ),
    Case(
        "truncated frame at orchestrator generate",
        frames("/omni.v1.Orchestrator/Generate", b"\x12\x10\x0a"),
        "INVALID_ARGUMENT",
        "GenerateRequest",
    ),
    # Frames that decode but say nothing we know.
    Case(
        "unknown field in submit",
        stage([stage_pb2.StageInput.FromString(b"\x0a\x06\x0a\x01h\xa0\x06\x01")]),
        "INVALID_ARGUMENT",
        "submit",
    ),
    Case(
        "unknown field in params",
        stage([stage_pb2.StageInput.FromString(b"\x0a\x07\x0a\x01h\x1a\x02\x78\x01")]),
        "INVALID_ARGUMENT",
        "params",
    ),
    Case(
        "submit with the wrong wire type",
        stage([stage_pb2.StageInput.FromString(b"\x08\x01")], rid=""),
        "INVALID_ARGUMENT",
        "input",
    ),
    Case(
        "request_id with the wrong wire type",
        stage([stage_pb2.StageInput.FromString(b"\x0a\x02\x08\x05")], rid=""),
        "INVALID_ARGUMENT",
        "submit",
    ),
    Case("empty frame", stage([stage_pb2.StageInput()], rid=""), "INVALID_ARGUMENT", "input"),
    # Tensors whose shape, dtype or bytes lie.
    Case(
        "dims overflow int64",
        stage([submit(tensors=[embeds([1 << 62, 64])])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shape",
    ),
    Case(
        "negative dim",
        stage([submit(tensors=[embeds([-1, 64], b"")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shape",
    ),
    Case(
        "ndim 64",
        stage([submit(tensors=[embeds([1] * 64, b"\0\0\0\0")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shape",
    ),
    Case(
        "shape and bytes disagree",
        stage([submit(tensors=[embeds([4, 64], b"\0" * 10)])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].raw",
    ),
    Case(
        "shape claims 2^40 bytes",
        stage([submit(tensors=[embeds([1 << 32, 64], b"")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].raw",
    ),
    Case(
        "chunked ref claims 2^40 bytes",
        stage(
            [
                submit(
                    tensors=[
                        embeds(
                            [1 << 32, 64], chunked=tensor_pb2.ChunkRef(chunk_id="c", nbytes=1 << 40)
                        )
                    ]
                )
            ]
        ),
        "INVALID_ARGUMENT",
        "inputs.tensors[0]",
    ),
    Case(
        "unknown dtype",
        stage([submit(tensors=[embeds([4, 64], FLOATS_4x64, dtype="float128")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].dtype",
    ),
    Case(
        "tensor without a name",
        stage(
            [submit(tensors=[tensor_pb2.Tensor(dtype="float32", shape=[4, 64], raw=FLOATS_4x64)])]
        ),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].name",
    ),
    Case(
        "tensor the engine does not take",
        stage(
            [
                submit(
                    tensors=[tensor_pb2.Tensor(name="x", dtype="float32", shape=[1], raw=bytes(4))]
                )
            ]
        ),
        "INVALID_ARGUMENT",
        "inputs.tensors.x",
    ),
    # Chunks that lie.
    Case(
        "first chunk not at offset 0",
        stage([chunk("c1", 5, b"abc", 10)], rid=""),
        "INVALID_ARGUMENT",
        "chunk",
    ),
    Case(
        "duplicate chunk",
        stage([chunk("c2", 0, bytes(512), 1024), chunk("c2", 0, bytes(512), 1024)], rid=""),
        "INVALID_ARGUMENT",
        "chunk",
    ),
    Case(
        "chunk past its total",
        stage([chunk("c3", 0, bytes(20), 10)], rid=""),
        "INVALID_ARGUMENT",
        "chunk",
    ),
    Case(
        "chunk without an id",
        stage([chunk("", 0, bytes(4), 4)], rid=""),
        "INVALID_ARGUMENT",
        "chunk",
    ),
    Case(
        "submit refers to an unknown chunk id",
        stage([chunk("c4", 0, bytes(1024), 1024), submit(tensors=[chunked("other", 4)])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0]",
    ),
    Case(
        "chunks never finished, then is_last",
        stage([chunk("c5", 0, bytes(512), 1024), submit(tensors=[chunked("c5", 4)])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0]",
    ),
    Case(
        "chunked nbytes disagree with the chunks",
        stage(
            [
                chunk("c6", 0, bytes(1024), 1024),
                submit(
                    tensors=[
                        embeds([4, 64], chunked=tensor_pb2.ChunkRef(chunk_id="c6", nbytes=2048))
                    ]
                ),
            ]
        ),
        "INVALID_ARGUMENT",
        "inputs.tensors[0]",
    ),
    Case(
        "chunked ref at the orchestrator, chunks missing",
        stream([submit(tensors=[chunked("c7", 4)])]),
        "INVALID_ARGUMENT",
        "submit.inputs.tensors[0]",
    ),
    # Shared blocks that are not the caller's to open.
    Case(
        "another request's block at the orchestrator",
        orchestrator(lambda mesh: orchestrator_request(mesh, victim(mesh))),
        "INVALID_ARGUMENT",
        "inputs.tensors[0]",
    ),
    Case(
        "another request's block at the orchestrator stream",
        lambda mesh: on_orchestrator_stream(mesh, [streamed(submit(tensors=[victim(mesh)]))], "h"),
        "INVALID_ARGUMENT",
        "submit.inputs.tensors[0]",
    ),
    Case(
        "another request's block from a stranger",
        stage(lambda mesh: [submit(tensors=[victim(mesh)])], who=None),
        "UNAUTHENTICATED",
        "",
    ),
    Case(
        "another request's block with a guessed secret",
        stage(lambda mesh: [submit(tensors=[victim(mesh, name=guessed(mesh))])]),
        "FAILED_PRECONDITION",
        "inputs.tensors[0].shm.name",
    ),
    Case(
        "a block that does not exist",
        stage(
            lambda mesh: [
                submit(tensors=[victim(mesh, name=f"omni-default-{os.getpid()}-fffff-{'ab' * 16}")])
            ]
        ),
        "FAILED_PRECONDITION",
        "inputs.tensors[0].shm.name",
    ),
    Case(
        "path traversal as a block name",
        stage(lambda mesh: [submit(tensors=[victim(mesh, name="../../etc/passwd")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shm.name",
    ),
    Case(
        "block name with a slash",
        stage(lambda mesh: [submit(tensors=[victim(mesh, name=mesh.victim.shm.name + "/../x")])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shm.name",
    ),
    Case(
        "block of another mesh",
        stage(
            lambda mesh: [
                submit(
                    tensors=[
                        victim(
                            mesh, name=mesh.victim.shm.name.replace("omni-default-", "omni-other-")
                        )
                    ]
                )
            ]
        ),
        "FAILED_PRECONDITION",
        "inputs.tensors[0].shm.name",
    ),
    Case(
        "ref past the end of its block",
        stage(lambda mesh: [submit(tensors=[victim(mesh, offset=1 << 40)])]),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shm.offset",
    ),
    Case(
        "ref from another node",
        stage(lambda mesh: [submit(tensors=[foreign(victim(mesh))])]),
        "FAILED_PRECONDITION",
        "inputs.tensors[0].shm",
    ),
    Case(
        "release another's blocks as a stranger",
        stranger_releases_the_victims_block,
        "UNAUTHENTICATED",
        "",
    ),
    Case("release guessed block names", mesh_releases_guessed_names, "OK", ""),
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
        "unknown extra key",
        stage([with_extra(submit(), frobnicate=1)]),
        "INVALID_ARGUMENT",
        "params.extra.",
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


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name for c in CATALOGUE])
async def test_hostile_input(mesh: Mesh, case: Case) -> None:
    control = asyncio.create_task(mesh.control(f"control-{case.name.replace(' ', '-')[:200]}"))
    try:
        outcome = await asyncio.wait_for(case.send(mesh), 60)
    finally:
        await asyncio.wait_for(control, 60)  # the ordinary request completed in full
    assert outcome.code == case.code, outcome
    assert case.field in outcome.field, outcome
    assert "<class" not in outcome.message + outcome.field and "Traceback" not in outcome.message
    await mesh.serving()
