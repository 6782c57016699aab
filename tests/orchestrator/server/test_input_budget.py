"""The orchestrator's front door holds a bounded amount of clients' input (chunks,
waiting windows, unary messages): per stream and for all streams together, given
back when a stream ends."""

from __future__ import annotations

import gc
import types

import grpc

from orchestrator.server.requests.flow import RequestFlow
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2, tensor_pb2
from tests.orchestrator.conftest import orchestrator, pipeline

MIB = 1 << 20


def first_chunk(chunk_id: str, total: int) -> orchestrator_pb2.StreamInput:
    chunk = tensor_pb2.TensorChunk(chunk_id=chunk_id, offset=0, data=bytes(MIB), total=total)
    return orchestrator_pb2.StreamInput(chunk=chunk)


async def barrier(call, rid: str) -> list[orchestrator_pb2.GenerateEvent]:
    """Every event until the stream has handled what was written before (a Cancel of
    an unknown id is answered in order)."""
    await call.write(orchestrator_pb2.StreamInput(cancel=stage_pb2.Cancel(request_id=rid)))
    events = []
    while True:
        event = await call.read()
        assert event is not grpc.aio.EOF
        events.append(event)
        if event.WhichOneof("kind") == "done" and event.done.request_id == rid:
            return events


async def test_unfinished_client_chunks_are_capped_across_streams(stages) -> None:
    runtime = {
        "max_message_bytes": 4 * MIB,
        "max_input_bytes": 8 * MIB,
        "max_process_input_bytes": 12 * MIB,
    }
    config = pipeline(stages, ["thinker"], [], runtime=runtime)
    async with orchestrator(config) as (server, client):
        first = client.stub.GenerateStream()
        await first.write(first_chunk("a", 7 * MIB))
        await barrier(first, "sync-a")
        assert server.input_budget.held == 7 * MIB
        second = client.stub.GenerateStream()
        await second.write(first_chunk("b", 7 * MIB))
        events = await barrier(second, "sync-b")
        refusal = events[0].done
        assert (refusal.request_id, refusal.code_name) == ("", "RESOURCE_EXHAUSTED")
        assert "max_process_input_bytes" in refusal.message
        assert server.input_budget.held == 7 * MIB
        ok = await client.generate("Hi", params={"max_tokens": 2}).collect()
        assert ok.ok
        for call in (first, second):
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        assert server.input_budget.held == 0


def window(rid: str, sequence: int, nbytes: int) -> orchestrator_pb2.StreamInput:
    tensor = tensor_pb2.Tensor(name="x", dtype="uint8", shape=[nbytes], raw=bytes(nbytes))
    submit = stage_pb2.Submit(
        request_id=rid, sequence=sequence, inputs=stage_pb2.StageInputs(tensors=[tensor])
    )
    return orchestrator_pb2.StreamInput(submit=submit)


async def test_windows_waiting_for_a_paused_mesh_are_capped_per_stream(stages) -> None:
    config = pipeline(stages, ["thinker"], [], runtime={"max_input_bytes": 8 * MIB})
    async with orchestrator(config) as (server, client):
        # Nothing reaches the stages: windows wait in the orchestrator.
        server.router.generation.pause()
        call = client.stub.GenerateStream()
        for sequence in range(3):
            await call.write(window("flood", sequence, 3 * MIB))
        events = await barrier(call, "sync")
        server.router.generation.resume()
        # The request ends in its own task: before or after the barrier's answer.
        while not any(e.done.request_id == "flood" for e in events):
            events.append(await call.read())
        done = next(e.done for e in events if e.done.request_id == "flood")
        assert (done.request_id, done.code_name) == ("flood", "RESOURCE_EXHAUSTED")
        assert done.field == "submit.inputs" and "max_input_bytes" in done.message
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
        assert server.input_budget.held == 0
        ok = await client.generate("Hi", params={"max_tokens": 2}).collect()
        assert ok.ok


async def test_a_refused_request_leaves_nothing_holding_its_input(stages) -> None:
    """A stage's refusal ends the request, and with it everything that held the
    client's input: no reference cycle (a traceback through the flow's frames, the
    TaskGroup's own) keeps it for the cyclic collector, which a quiet server may
    not run for minutes (issue 35: 480 MB kept after eight 60 MB requests)."""
    request = orchestrator_pb2.GenerateRequest(request_id="refused")
    request.inputs.tensors.add(name="x", dtype="uint8", shape=[4 * MIB], raw=bytes(4 * MIB))
    async with orchestrator(pipeline(stages, ["thinker"], [])) as (_server, client):
        gc.collect()
        gc.disable()
        events = []
        try:
            async for event in client.stub.Generate(request):
                events.append(event)
        except grpc.aio.AioRpcError:
            pass  # the RPC ends with the Done's status; the Done came first
        finally:
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            garbage, gc.garbage[:] = list(gc.garbage), []
            gc.set_debug(0)
            gc.enable()
    assert events[-1].done.code_name == "INVALID_ARGUMENT" and events[-1].done.stage == "thinker"
    kept = [
        type(o).__name__
        for o in garbage
        if isinstance(o, RequestFlow | stage_pb2.Submit | orchestrator_pb2.GenerateRequest)
        or (isinstance(o, types.FrameType) and "orchestrator" in o.f_code.co_filename)
    ]
    assert not kept, f"left for the cyclic collector: {kept}"
