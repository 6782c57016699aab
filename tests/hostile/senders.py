"""How a hostile input reaches a real server, and what came back: each sender
returns the ``Outcome`` of the request (or RPC) under test after checking the
invariants every answer must keep (one final event per request id, the stream
itself ending OK, the stream's ordinary request completing in full)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.rpc.stage_client import chat_submit
from tests.hostile.conftest import Mesh

SAME_STREAM_TOKENS = 6  # the ordinary request that shares the hostile request's stream
LONG = 400  # max_tokens of a request that is still running when the next message comes


@dataclass(frozen=True)
class Outcome:
    code: str  # a grpc status name; "OK" for a request that completed
    field: str  # the Error's / Done's field, or an RPC status's details
    message: str = ""


@dataclass(frozen=True)
class Running:
    """In a message list: wait until this request has produced its first segment."""

    request_id: str


def _ordinary(request_id: str) -> stage_pb2.StageInput:
    submit = chat_submit(request_id, "Say hi.", max_tokens=SAME_STREAM_TOKENS, temperature=0.0)
    return stage_pb2.StageInput(submit=submit)


async def on_stage(
    mesh: Mesh,
    messages: Sequence[stage_pb2.StageInput | Running],
    request_id: str,
    *,
    who: str | None = "mesh",
) -> Outcome:
    """Messages on one Stage.Generate stream, after an ordinary request of its own."""
    ordinary = f"ordinary-{id(messages):x}"
    async with mesh.stage(who) as stage:
        call = stage.open_stream(timeout_s=60)
        outputs: list[stage_pb2.StageOutput] = []
        if who is None:
            # A stranger is refused on its metadata, before any message is read. Its
            # verdict is taken first: a write that races the refusal fails inside
            # grpcio's client as INTERNAL "Internal error from Core" and hides it (grpc/grpc#36066).
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                return Outcome(exc.code().name, exc.details() or "")
            raise AssertionError(f"a stranger's stream was answered: {first}")
        try:
            await call.write(_ordinary(ordinary))
            for message in messages:
                if isinstance(message, Running):
                    while True:
                        output = await call.read()
                        assert output is not grpc.aio.EOF
                        outputs.append(output)
                        if (
                            output.WhichOneof("kind") == "segment"
                            and output.segment.request_id == message.request_id
                        ):
                            break
                else:
                    await call.write(message)
            await call.done_writing()
            while (output := await call.read()) is not grpc.aio.EOF:
                outputs.append(output)
        except grpc.aio.AioRpcError as exc:  # the RPC itself refused (auth)
            return Outcome(exc.code().name, exc.details() or "")
        assert await call.code() == grpc.StatusCode.OK  # an error never ends the stream
    finals: Counter[str] = Counter()
    last: dict[str, stage_pb2.StageOutput] = {}
    tokens = 0
    for output in outputs:
        kind = output.WhichOneof("kind")
        if kind == "segment" and output.segment.request_id == ordinary:
            tokens += len(output.segment.token_ids)
        if kind in ("completed", "error"):
            event = getattr(output, kind)
            finals[event.request_id] += 1
            last[event.request_id] = output
    assert finals[ordinary] == 1 and last[ordinary].WhichOneof("kind") == "completed"
    assert tokens == SAME_STREAM_TOKENS, "the stream's ordinary request lost tokens"
    assert all(n == 1 for n in finals.values()), finals
    final = last.get(request_id)
    assert final is not None, f"no final event for {request_id[:40]!r}: {finals}"
    if final.WhichOneof("kind") == "completed":
        return Outcome("OK", "")
    return Outcome(final.error.code_name, final.error.field, final.error.message)


async def raw_frames(mesh: Mesh, method: str, frames: Sequence[bytes]) -> Outcome:
    """Raw frames on a streaming method of the stage ("/omni.v1.Stage/…") or the
    orchestrator; the outcome is the RPC's status."""
    stage = method.startswith("/omni.v1.Stage/")
    token = mesh.mesh_token if stage else mesh.tokens["alice"]
    address = mesh.stage_address if stage else mesh.address
    metadata = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            if method.endswith("/Generate") and not stage:
                call = channel.unary_stream(method)(frames[0], metadata=metadata, timeout=30)
                _ = [reply async for reply in call]
            else:
                stream = channel.stream_stream(method)(metadata=metadata, timeout=30)
                for frame in frames:
                    await stream.write(frame)
                await stream.done_writing()
                _ = [reply async for reply in stream]
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "")
    return Outcome("OK", "")


def _done(events: Sequence[orchestrator_pb2.GenerateEvent], request_id: str) -> Outcome:
    dones: Counter[str] = Counter(
        e.done.request_id for e in events if e.WhichOneof("kind") == "done"
    )
    assert all(n == 1 for n in dones.values()), dones
    (done,) = [
        e.done for e in events if e.WhichOneof("kind") == "done" and e.done.request_id == request_id
    ]
    return Outcome(done.code_name, done.field, done.message)


async def at_orchestrator(
    mesh: Mesh, request: orchestrator_pb2.GenerateRequest, *, who: str | None = "alice"
) -> Outcome:
    """One Orchestrator.Generate: its events end in exactly one Done."""
    async with mesh.client(who) as client:
        call = client.stub.Generate(request, metadata=client.metadata, timeout=60)
        events: list[orchestrator_pb2.GenerateEvent] = []
        try:
            async for event in call:
                events.append(event)
        except grpc.aio.AioRpcError as exc:
            if not events:
                return Outcome(exc.code().name, exc.details() or "")
            # A failed request's RPC ends with the status its Done reported.
            assert exc.code().name == events[-1].done.code_name, (exc, events[-1])
    assert events and events[-1].WhichOneof("kind") == "done"
    return _done(events, events[-1].done.request_id)


async def on_orchestrator_stream(
    mesh: Mesh,
    messages: Sequence[orchestrator_pb2.StreamInput | Running],
    request_id: str,
    *,
    who: str | None = "alice",
) -> Outcome:
    """Messages on one Orchestrator.GenerateStream, after an ordinary request of its own."""
    ordinary = f"ordinary-{id(messages):x}"
    async with mesh.client(who) as client:
        call = client.stub.GenerateStream(metadata=client.metadata, timeout=60)
        events: list[orchestrator_pb2.GenerateEvent] = []
        try:
            await call.write(orchestrator_pb2.StreamInput(submit=_ordinary(ordinary).submit))
            for message in messages:
                if isinstance(message, Running):
                    while True:
                        event = await call.read()
                        assert event is not grpc.aio.EOF
                        events.append(event)
                        if event.segment.request_id == message.request_id:
                            break
                else:
                    await call.write(message)
            await call.done_writing()
            while (event := await call.read()) is not grpc.aio.EOF:
                events.append(event)
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "")
    tokens = sum(len(e.segment.token_ids) for e in events if e.segment.request_id == ordinary)
    assert _done(events, ordinary).code == "OK"
    assert tokens == SAME_STREAM_TOKENS, "the stream's ordinary request lost tokens"
    return _done(events, request_id)
