"""The catalogue, on the wire: frames that are no message, fields nobody
knows, tensors whose shape, dtype or bytes lie, chunks that lie, and shared
blocks that are not the caller's to open."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from tests.hostile.cases import (
    VICTIM,
    Case,
    absent,
    chunk,
    chunked,
    embeds,
    foreign,
    frames,
    guessed,
    orchestrator,
    orchestrator_request,
    stage,
    stream,
    streamed,
    submit,
    victim,
)
from tests.hostile.control_plane import (
    mesh_releases_guessed_names,
    stranger_releases_the_victims_block,
)
from tests.hostile.senders import LONG, Outcome, on_orchestrator_stream, raw_frames


async def repeated(times: int, send: Callable[..., Awaitable[Outcome]], *args: Any) -> Outcome:
    """The outcome of ``send`` if it is the same every time (a race shows on some)."""
    outcomes = {await send(*args) for _ in range(times)}
    assert len(outcomes) == 1, outcomes
    return outcomes.pop()


GENERATE = "/omni.v1.Stage/Generate"
VALID = submit("cut").SerializeToString()
NAN = float("nan")
FLOATS_4x64 = bytes(4 * 64 * 4)

WIRE = [
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
        "garbage frame after a request in flight",
        frames(GENERATE, submit("held", max_tokens=LONG).SerializeToString(), b"\xff\xff"),
        "INVALID_ARGUMENT",
        "StageInput",
    ),
    Case(
        "garbage frame after a request in flight at orchestrator stream",
        frames(
            "/omni.v1.Orchestrator/GenerateStream",
            submit("held", max_tokens=LONG).SerializeToString(),
            b"\xff\xff",
        ),
        "INVALID_ARGUMENT",
        "StreamInput",
    ),
    Case(
        # An abort from the task reading the frames raced the handler's writes: hung.
        "garbage frame as a short request ends, at orchestrator stream",
        lambda mesh: repeated(
            3,
            raw_frames,
            mesh,
            "/omni.v1.Orchestrator/GenerateStream",
            [submit("short", max_tokens=2).SerializeToString(), b"\xff\xff"],
        ),
        "INVALID_ARGUMENT",
        "StreamInput",
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
        stage(lambda mesh: [submit(VICTIM, tensors=[victim(mesh, name=guessed(mesh))])], VICTIM),
        "FAILED_PRECONDITION",
        "inputs.tensors[0].shm.name",
    ),
    Case(
        "a block that does not exist",
        stage(lambda mesh: [submit(VICTIM, tensors=[victim(mesh, name=absent(mesh))])], VICTIM),
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
        stage(lambda mesh: [submit(VICTIM, tensors=[victim(mesh, offset=1 << 40)])], VICTIM),
        "INVALID_ARGUMENT",
        "inputs.tensors[0].shm.offset",
    ),
    Case(
        "ref from another node",
        stage(lambda mesh: [submit(VICTIM, tensors=[foreign(victim(mesh))])], VICTIM),
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
]
