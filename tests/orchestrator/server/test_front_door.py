"""A real orchestrator over real stage processes, as its clients see it: abort,
disconnect, pause, requests refused by name, GenerateStream's windows and chunks,
the stage views, the sync client and the message limit."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.client import AsyncClient, Client, Result
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2, tensor_pb2
from services.mesh.rpc.stage_client import StageClient
from tests.helpers.polling import eventually
from tests.orchestrator.conftest import RENDER_DIM, THINK_TO_RENDER, orchestrator, pipeline


async def test_abort_reaches_every_stage_and_the_client_gets_a_final_status(stages) -> None:
    edges = [{"from": "thinker", "to": "talker", "window": 1, "transform": "tokens"}]
    config = pipeline(stages, ["thinker", "talker"], edges, outputs=["thinker", "talker"])
    async with orchestrator(config) as (_server, client):
        stream = client.generate(
            "Go on", params={"max_tokens": 2000, "seed": 4}, request_id="long"
        ).__aiter__()
        result = Result()
        while "thinker" not in result.stages:
            result.add(await stream.__anext__())
        reply = await client.abort("long", "nobody")
        assert list(reply.aborted) == ["long"] and list(reply.not_found) == ["nobody"]
        async for event in stream:
            result.add(event)
    assert result.done.code_name == "CANCELLED" and "aborted" in result.done.message
    assert 0 < len(result.stages["thinker"].token_ids) < 2000
    for name in ("thinker", "talker"):  # neither stage still holds the request
        async with StageClient(stages.addresses[name]) as stage:
            assert list((await stage.abort("long")).not_found) == ["long"]


async def test_client_disconnect_cancels_the_request_on_the_stages(stages) -> None:
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (server, client):
        call = client.stub.Generate(
            orchestrator_pb2.GenerateRequest(
                request_id="gone",
                inputs=stage_pb2.StageInputs(text="Hello"),
                params=stage_pb2.GenerationParams(max_tokens=2000),
            )
        )
        await call.read()
        call.cancel()
        await eventually(lambda: server.router.in_flight == 0, 5, message="still in flight")
        async with StageClient(stages.addresses["thinker"]) as stage:
            assert list((await stage.abort("gone")).not_found) == ["gone"]


async def test_pause_holds_new_requests_until_resume(stages) -> None:
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (server, client):
        await client.pause()
        pending = asyncio.ensure_future(client.generate("Hi", params={"max_tokens": 2}).collect())
        await eventually(lambda: server.router.generation.held == 1, 30, message="never held")
        assert not pending.done()  # held at the pause, before any stage saw it
        await client.resume()
        assert (await asyncio.wait_for(pending, 30)).ok


async def test_bad_requests_are_refused_by_name_with_one_done(stages) -> None:
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (_server, client):
        unknown = await client.generate("Hi", stage_params={"nobody": {"max_tokens": 1}}).collect()
        assert unknown.done.code_name == "INVALID_ARGUMENT"
        assert unknown.done.field == "stage_params.nobody"
        assert "stage_params.nobody: unknown stage" in unknown.done.message
        # A client may not hand the mesh a shared-memory ref: it names mesh memory.
        ref = stage_pb2.StageInputs(text="x")
        ref.tensors.add(name="prompt_embeds", dtype="float32", shape=[1]).shm.name = "omni-x-1-1"
        refused = await client.generate(inputs=ref).collect()
        assert refused.done.code_name == "INVALID_ARGUMENT"
        assert refused.done.field == "inputs.tensors[0]"
        assert "tensor refs are only accepted from inside the mesh" in refused.done.message
        # Nor a pull ref: it would send a stage to dial whatever address it names.
        with socket.create_server(("127.0.0.1", 0)) as bait:
            bait.settimeout(0.5)
            pull = stage_pb2.StageInputs(text="x")
            tensor = pull.tensors.add(name="prompt_embeds", dtype="uint8", shape=[4])
            address = f"127.0.0.1:{bait.getsockname()[1]}"
            tensor.pull.CopyFrom(tensor_pb2.PullRef(address=address, key=b"k" * 16, nbytes=4))
            refused = await client.generate(inputs=pull).collect()
            assert refused.done.code_name == "INVALID_ARGUMENT"
            assert refused.done.field == "inputs.tensors[0]"
            assert "tensor refs are only accepted from inside the mesh" in refused.done.message
            with pytest.raises(TimeoutError):
                bait.accept()  # nobody dialled it
        # A per-stage error ends the request with the stage's code, naming stage and field.
        result = await client.generate("Hi", params={"max_tokens": -3}).collect()
        assert result.done.code_name == "INVALID_ARGUMENT" and result.done.stage == "thinker"
        assert result.done.field == "params.max_tokens"
        assert "params.max_tokens" in result.done.message
        assert (await client.generate("Hi", params={"max_tokens": 2}).collect()).ok


async def test_a_request_id_already_in_flight_gets_one_done_and_the_first_goes_on(stages) -> None:
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (_server, client):
        first = client.generate("Go on", params={"max_tokens": 12}, request_id="twice").__aiter__()
        started = await first.__anext__()  # the first request is in flight now
        events = [e async for e in client.generate("Hi", request_id="twice")]
        assert [e.WhichOneof("kind") for e in events] == ["done"]
        done = events[0].done
        assert done.code_name == "INVALID_ARGUMENT" and done.field == "request_id"
        assert "'twice' is already in flight" in done.message and "." not in done.code_name
        rest = Result()
        rest.add(started)
        async for event in first:
            rest.add(event)
    assert rest.ok and len(rest.stages["thinker"].token_ids) == 12


async def test_list_watch_health_and_the_sync_client(stages) -> None:
    config = pipeline(stages, ["thinker", "renderer"], THINK_TO_RENDER)
    async with orchestrator(config) as (server, client):
        listed = await client.list_stages()
        assert {s.name: s.state for s in listed} == {
            "thinker": orchestrator_pb2.STAGE_READY,
            "renderer": orchestrator_pb2.STAGE_READY,
        }
        watch = client.watch_stages()
        first = [await watch.read() for _ in range(2)]
        watch.cancel()
        assert {s.name for s in first} == {"thinker", "renderer"}
        health = health_pb2_grpc.HealthStub(client.channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="omni.v1.Orchestrator"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        def sync_call() -> Result:
            with Client(f"127.0.0.1:{server.port}") as sync:
                assert len(sync.list_stages()) == 2
                return sync.collect("Paint.", params={"max_tokens": 3})

        result = await asyncio.to_thread(sync_call)
        assert result.ok and "image" in result.stages["renderer"].tensors


async def stream(client: AsyncClient, messages: list[orchestrator_pb2.StreamInput]) -> Result:
    call = client.stub.GenerateStream()
    for message in messages:
        await call.write(message)
    await call.done_writing()
    result = Result()
    result.dones = []  # type: ignore[attr-defined]
    while (event := await call.read()) is not grpc.aio.EOF:
        if event.WhichOneof("kind") == "done":
            result.dones.append(event.done)  # type: ignore[attr-defined]
        result.add(event)
    return result


def window(
    rid: str, seq: int, last: bool, text: str = "", **params: Any
) -> orchestrator_pb2.StreamInput:
    submit = stage_pb2.Submit(request_id=rid, sequence=seq, is_last=last)
    submit.inputs.text = text
    for key, value in params.items():
        setattr(submit.params, key, value)
    return orchestrator_pb2.StreamInput(submit=submit)


async def test_generate_stream_takes_input_windows(stages) -> None:
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (_server, client):
        result = await stream(
            client, [window("w", 0, False, "Hello ", max_tokens=3), window("w", 1, True, "there")]
        )
    assert result.ok and len(result.stages["thinker"].token_ids) == 3


async def test_generate_stream_takes_tensor_chunks_and_stage_params(stages) -> None:
    config = pipeline(
        stages, ["thinker", "renderer"], THINK_TO_RENDER, outputs=["thinker", "renderer"]
    )
    rows = 5
    embeds = torch.randn(rows, RENDER_DIM)
    raw = embeds.numpy().tobytes()
    half = len(raw) // 2
    chunks = [
        orchestrator_pb2.StreamInput(
            chunk=tensor_pb2.TensorChunk(chunk_id="c1", offset=0, data=raw[:half], total=len(raw))
        ),
        orchestrator_pb2.StreamInput(
            chunk=tensor_pb2.TensorChunk(
                chunk_id="c1", offset=half, data=raw[half:], total=len(raw)
            )
        ),
    ]
    # The renderer alone, fed prompt embeddings in two chunks: the pipeline's entry
    # is the thinker, so send the embeddings as the thinker's prompt instead.
    submit = stage_pb2.Submit(request_id="chunked", is_last=True)
    tensor = submit.inputs.tensors.add(
        name="prompt_embeds", dtype="float32", shape=[rows, RENDER_DIM]
    )
    tensor.chunked.chunk_id, tensor.chunked.nbytes = "c1", len(raw)
    submit.params.max_tokens = 4
    message = orchestrator_pb2.StreamInput(submit=submit)
    message.stage_params["renderer"].num_inference_steps = 2
    message.stage_params["renderer"].preview_every = 1
    async with orchestrator(config) as (_server, client):
        result = await stream(client, [*chunks, message])
    assert result.ok, result.done
    assert result.stages["thinker"].completed.usage.prompt_tokens == rows
    assert len(result.stages["thinker"].token_ids) == 4
    renderer = result.stages["renderer"]
    assert "image" in renderer.tensors
    assert renderer.progress == 2  # stage_params reached it: a preview per step, 2 steps


async def test_generate_stream_bad_messages_end_one_request_each_with_one_done(stages) -> None:
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (_server, client):
        result = await stream(
            client,
            [
                window("ok", 0, True, "Hi", max_tokens=3),
                window("late", 0, True, "Hi", max_tokens=40),
                window("late", 1, True, "more"),  # after its last window: ends it
                orchestrator_pb2.StreamInput(cancel=stage_pb2.Cancel(request_id="ghost")),
                window("", 0, True, "no id"),
            ],
        )
    dones = {d.request_id: d for d in result.dones}  # type: ignore[attr-defined]
    assert sorted(d.request_id for d in result.dones) == ["", "ghost", "late", "ok"]  # type: ignore[attr-defined]
    assert dones["ok"].code_name == "OK"
    assert dones["late"].code_name == "INVALID_ARGUMENT"
    assert dones["late"].field == "submit.request_id" and "last window" in dones["late"].message
    assert dones["ghost"].code_name == "NOT_FOUND"
    assert dones[""].code_name == "INVALID_ARGUMENT" and dones[""].field == "submit.request_id"


async def test_an_oversized_message_is_refused_at_the_door_and_others_go_on(stages) -> None:
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (server, client):
        assert server.max_message_bytes == 64 << 20
        huge = "x" * (server.max_message_bytes + 1024)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(huge, params={"max_tokens": 2}).collect()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await client.generate("Hi", params={"max_tokens": 2}).collect()).ok


async def test_small_unary_calls_free_no_memory_to_trim(stages) -> None:
    """Each unary call reserves the largest message it may be, then hands the unused
    part back: bookkeeping, not freed memory. Only the bytes messages really held
    count toward trimming the heap (issue 24's profile: a timer every 2 s and a
    malloc_trim every 10 s under steady small traffic)."""
    config = pipeline(stages, ["thinker"], [])
    async with orchestrator(config) as (server, client):
        assert server.max_message_bytes > 1 << 20  # reserves far beyond the messages
        for n in range(8):
            result = await client.generate(f"hello {n}", params={"max_tokens": 1}).collect()
            assert result.ok, result.done
        assert 0 < server.freed.pending_bytes < 8 * 4096, server.freed.pending_bytes
        assert server.freed.trims == 0
