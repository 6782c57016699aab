"""Requests routed through real stage processes by a real orchestrator: what
crosses each edge (full and windowed triggers, transforms, hidden states by
shared memory or as bytes) and requests in different stages at once."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from orchestrator.client import AsyncClient, Result
from orchestrator.server.server import OrchestratorServer
from services.mesh.errors import InitFailed
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.tensors import codec
from tests.helpers.polling import eventually
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
