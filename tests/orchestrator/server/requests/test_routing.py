"""Requests routed through real stage processes by a real orchestrator: what
crosses each edge (full and windowed triggers, transforms, hidden states by
shared memory or as bytes) and requests in different stages at once."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from orchestrator.client import AsyncClient, Events, Result
from orchestrator.client.requests import make_request, stream_inputs
from orchestrator.server.server import OrchestratorServer
from services.mesh.errors import InitFailed
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.tensors import codec
from tests.helpers.polling import eventually
from tests.helpers.ports import free_port
from tests.helpers.shm_blocks import blocks_of
from tests.orchestrator.conftest import RENDER_DIM, THINK_TO_RENDER, orchestrator, pipeline


async def test_thinker_hidden_states_condition_the_renderer(stages) -> None:
    config = pipeline(
        stages, ["thinker", "renderer"], THINK_TO_RENDER, outputs=["thinker", "renderer"]
    )
    params = {"max_tokens": 6, "seed": 1, "return_hidden_states": True}
    async with orchestrator(config) as (_server, client):
        events = []
        async for event in client.generate("Draw a cat.", params=params):
            events.append(event)
    result = Result()
    for event in events:
        result.add(event)
    assert result.ok, result.done
    kinds = [(e.stage, e.WhichOneof("kind")) for e in events]
    # The thinker's events all come first (full trigger), then the renderer's, then Done.
    last_thinker = max(i for i, (s, _) in enumerate(kinds) if s == "thinker")
    first_renderer = min(i for i, (s, _) in enumerate(kinds) if s == "renderer")
    assert last_thinker < first_renderer and kinds[-1] == ("", "done")
    thinker = result.stages["thinker"]
    assert len(thinker.token_ids) == 6 and thinker.completed is not None
    # They went to the renderer by shared memory; the client asked too, so it gets bytes.
    hidden = codec.from_proto(codec.concat_raw(thinker.tensors["hidden_states"], "h"))
    assert hidden.shape == (6, RENDER_DIM)
    (image,) = result.stages["renderer"].tensors["image"]
    assert codec.from_proto(image).dtype == torch.uint8 and list(image.shape)[-1] == 3


async def test_windowed_edge_forwards_windows_in_order(stages) -> None:
    edges = [{"from": "thinker", "to": "talker", "window": 3, "transform": "tokens"}]
    config = pipeline(stages, ["thinker", "talker"], edges)
    async with orchestrator(config) as (_server, client):
        result = await client.generate(
            "Hi", params={"max_tokens": 7, "seed": 2}, stage_params={"talker": {"max_tokens": 4}}
        ).collect()
    assert result.ok, result.done
    assert list(result.stages) == ["talker"]  # default outputs: the leaves
    assert len(result.stages["talker"].token_ids) == 4


async def test_requests_pipeline_across_stages(stages) -> None:
    edges = [{"from": "thinker", "to": "talker", "transform": "tokens"}]
    config = pipeline(stages, ["thinker", "talker"], edges, outputs=["thinker", "talker"])
    params = {"max_tokens": 48, "seed": 3}
    talker = {"talker": {"max_tokens": 48, "seed": 3}}
    async with orchestrator(config) as (_server, client):
        await client.generate("warm", params=params, stage_params=talker).collect()
        done_at: dict[tuple[int, str], float] = {}

        async def run(index: int) -> Result:
            result = Result()
            async for event in client.generate(f"r{index}", params=params, stage_params=talker):
                result.add(event)
                if event.WhichOneof("kind") == "completed":
                    done_at[(index, event.stage)] = time.monotonic()
            return result

        results = await asyncio.gather(*(run(i) for i in range(4)))
    assert all(r.ok for r in results)
    # Some request's thinker finished while an earlier one was still in the talker:
    # different requests occupied different stages at once. (How close this comes
    # to the ideal pipeline is measured by benchmarks/mesh_overhead.py.)
    assert any(
        done_at[(j, "thinker")] < done_at[(i, "talker")]
        for i in range(4)
        for j in range(4)
        if j != i
    )


def dev_shm() -> set[str]:
    return set(blocks_of("default"))


async def test_hidden_states_go_by_shared_memory_not_through_the_orchestrator(stages) -> None:
    config = pipeline(stages, ["thinker", "renderer"], THINK_TO_RENDER, outputs=["renderer"])
    before = dev_shm()
    async with orchestrator(config) as (server, client):
        result = await client.generate(
            "Draw a river.", params={"max_tokens": 48, "seed": 6}, request_id="shm"
        ).collect()
        assert result.ok, result.done
        assert "image" in result.stages["renderer"].tensors
        # 48 rows of 64 float32 = 12 KiB of hidden states; what crossed the
        # orchestrator from the thinker is the refs and token ids only: about 3 KiB,
        # more or less with how many messages the tokens were grouped into (timing).
        # Half the hidden states' size is far above that and far below them as bytes.
        assert server.router.recent_bytes["shm"]["thinker"] < 48 * 64 * 4 // 2
        # Released by the orchestrator once the request is over.
        await eventually(lambda: dev_shm() <= before, 5, message=lambda: f"{dev_shm()} blocks")


async def test_with_two_consumers_hidden_states_travel_as_bytes(stages) -> None:
    # Refs go to a single consumer: with two children the stage sends bytes.
    edges = [*THINK_TO_RENDER, {"from": "thinker", "to": "talker", "transform": "tokens"}]
    config = pipeline(stages, ["thinker", "renderer", "talker"], edges, outputs=["renderer"])
    async with orchestrator(config) as (server, client):
        result = await client.generate(
            "Draw a river.", params={"max_tokens": 48, "seed": 6}, request_id="bytes"
        ).collect()
        assert result.ok, result.done
        assert server.router.recent_bytes["bytes"]["thinker"] > 12 * 1024


async def test_the_stages_say_which_transforms_exist_and_what_they_need(stages) -> None:
    config = pipeline(stages, ["thinker", "renderer"], THINK_TO_RENDER, outputs=["renderer"])
    async with orchestrator(config) as (server, client):
        offered = {
            t.name: list(t.needs_tensors) for t in server.descriptions["renderer"].transforms
        }
        assert offered["hidden_states_to_prompt_embeds"] == ["hidden_states"]
        assert offered["tokens"] == [] and offered["text"] == []
    # An edge naming a transform its stage does not offer fails start-up: that stage
    # shows FAILED naming the edge, health is NOT_SERVING, requests are refused.
    edges = [{"from": "thinker", "to": "talker", "transform": "no_such_transform"}]
    server = OrchestratorServer(pipeline(stages, ["thinker", "talker"], edges))
    port = await server.start("127.0.0.1", 0)
    try:
        with pytest.raises(InitFailed, match="does not offer"):
            await server.wait_ready(60)
        assert server.misconfigured.keys() == {"talker"}
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            talker = {s.name: s for s in await client.list_stages()}["talker"]
            assert talker.state == orchestrator_pb2.STAGE_FAILED
            assert "thinker -> talker: stage talker does not offer transform " in talker.message
            assert "'no_such_transform'" in talker.message
            assert "hidden_states_to_prompt_embeds" in talker.message  # what it does offer
            assert not await client.serving()
            result = await client.generate("Hi", params={"max_tokens": 2}).collect()
        assert result.done.code_name == "UNAVAILABLE" and result.done.stage == "talker"
        assert "does not offer transform 'no_such_transform'" in result.done.message
    finally:
        await server.stop(1.0)


THREE_WAYS = [
    *THINK_TO_RENDER,
    {"from": "thinker", "to": "talker", "window": 3, "transform": "tokens"},
]


async def test_a_request_runs_only_the_stages_its_outputs_need(stages) -> None:
    # The renderer's address has nothing behind it: a request that needs it cannot
    # run, one that names only the thinker and the talker runs without waiting.
    nowhere = {"renderer": f"127.0.0.1:{free_port()}"}
    config = pipeline(
        stages,
        ["thinker", "renderer", "talker"],
        THREE_WAYS,
        outputs=["thinker", "renderer", "talker"],
    ).with_addresses(nowhere)
    server = OrchestratorServer(config)
    port = await server.start("127.0.0.1", 0)
    params = {"max_tokens": 6, "seed": 4}
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            listed = await client.list_stages()
            assert {s.name: s.output for s in listed} == dict.fromkeys(config.names, True)
            ready = orchestrator_pb2.STAGE_READY

            async def up() -> bool:
                states = {s.name: s.state for s in await client.list_stages()}
                return states["thinker"] == states["talker"] == ready

            await eventually(up, 60)
            both = await client.generate(
                "Hi", params=params, outputs=["thinker", "talker"], request_id="both"
            ).collect()
            assert both.ok, both.done
            assert list(both.stages) == ["thinker", "talker"]
            # The talker took every token the thinker wrote (the seam, as it ran).
            thinker = both.stages["thinker"].completed
            talker = both.stages["talker"].completed
            assert thinker is not None and talker is not None
            assert talker.usage.prompt_tokens == thinker.usage.completion_tokens == 6
            # Named alone, the talker's events are all that come back; the thinker ran.
            alone = await client.generate("Hi", params=params, outputs=["talker"]).collect()
            assert alone.ok, alone.done
            assert list(alone.stages) == ["talker"]
            assert alone.stages["talker"].token_ids == both.stages["talker"].token_ids
            # Every output (the default) needs the renderer: it waits for it, in vain.
            # (The orchestrator's Done and the client's own deadline race: either ends it.)
            try:
                every = await client.generate("Hi", params=params, timeout_s=3).collect()
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            else:
                assert not every.ok and "renderer is not ready" in every.done.message, every.done
    finally:
        await server.stop(1.0)


async def test_a_producer_is_not_asked_for_what_only_a_stage_left_out_takes(stages) -> None:
    # With the renderer and the talker both fed, the thinker sends its hidden
    # states as bytes (test_with_two_consumers_...); without the renderer, nothing
    # asks for them and what the orchestrator reads from it is tokens alone.
    config = pipeline(
        stages, ["thinker", "renderer", "talker"], THREE_WAYS, outputs=["renderer", "talker"]
    )
    params = {"max_tokens": 48, "seed": 6}
    async with orchestrator(config) as (server, client):
        full = await client.generate("Draw.", params=params, request_id="full").collect()
        spoken = await client.generate(
            "Draw.", params=params, request_id="spoken", outputs=["talker"]
        ).collect()
    assert full.ok and spoken.ok, (full.done, spoken.done)
    assert (
        list(spoken.stages) == ["talker"] and "renderer" not in server.router.recent_bytes["spoken"]
    )
    hidden = 48 * 64 * 4  # 48 rows of the tiny thinker's 64 float32s
    assert server.router.recent_bytes["full"]["thinker"] > hidden
    assert server.router.recent_bytes["spoken"]["thinker"] < hidden // 2


async def test_outputs_that_are_not_the_pipelines_are_refused_by_name(stages) -> None:
    config = pipeline(stages, ["thinker", "talker"], THREE_WAYS[1:], outputs=["talker"])
    async with orchestrator(config) as (_server, client):
        listed = {s.name: s.output for s in await client.list_stages()}
        assert listed == {"thinker": False, "talker": True}
        cases = {
            ("thinker",): ("outputs[0]", "'thinker' is not one of the pipeline's outputs (talker)"),
            ("talker", "talker"): ("outputs[1]", "'talker' is named twice"),
            ("nobody",): ("outputs[0]", "'nobody' is not one of"),
        }
        for outputs, (field, said) in cases.items():
            for streamed in (False, True):
                request = make_request("Hi", outputs=outputs, request_id=f"r{streamed}")
                done = (await refused(client, request, streamed)).done
                assert done.code_name == "INVALID_ARGUMENT" and done.field == field, done
                assert said in done.message, done
        # A stage run alone has itself as its one output.
        alone = make_request("Hi", stage="thinker", outputs=["talker"], params={"max_tokens": 2})
        done = (await refused(client, alone, streamed=False)).done
        assert done.field == "outputs[0]" and "(thinker)" in done.message, done
        # The stream still serves: a good request after the refusals.
        result = await client.generate("Hi", params={"max_tokens": 2}).collect()
        assert result.ok, result.done


async def test_a_stage_alone_by_generate_stream(stages) -> None:
    # GenerateStream carries the request's stage too (large media go that way).
    config = pipeline(stages, ["thinker", "talker"], THREE_WAYS[1:])
    async with orchestrator(config) as (_server, client):
        request = make_request("Hi", stage="thinker", params={"max_tokens": 3}, request_id="a")
        result = await refused(client, request, streamed=True)
        assert result.ok, result.done
        assert list(result.stages) == ["thinker"] and len(result.stages["thinker"].token_ids) == 3
        request.stage_params["talker"].max_tokens = 2
        done = (await refused(client, request, streamed=True)).done
        assert done.field == "stage_params" and "submit.params" in done.message, done


async def refused(client: AsyncClient, request, streamed: bool) -> Result:
    """What ``request`` gets, sent as it is by Generate or GenerateStream."""
    if streamed:
        call = client.stub.GenerateStream(iter(stream_inputs(request)))
    else:
        call = client.stub.Generate(request)
    return await Events(call, request.request_id).collect()
