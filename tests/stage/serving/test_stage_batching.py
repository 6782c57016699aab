"""Batching through a real Stage server: requests on one Generate stream share the
engine's steps, the memory plan reaches the engine, and queue time is reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.engines.transformers import TransformersEngine
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config
from tests.helpers.stage import chat, collect


async def start(config: dict[str, Any]) -> tuple[StageServer, StageClient]:
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    client = StageClient(f"127.0.0.1:{port}")
    await client.wait_ready(timeout_s=300)
    return server, client


async def run_all(client: StageClient, inputs: list[stage_pb2.StageInput]) -> dict[str, Any]:
    call = client.open_stream()
    for message in inputs:
        await call.write(message)
    await call.done_writing()
    return await collect(call)


async def test_one_stream_of_requests_shares_steps_within_the_memory_plan(
    omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    config = tiny_config("batcher", omni_cache_dir, runtime={"max_batch_size": 4})
    server, client = await start(config)
    try:
        engine = server.runtime.engine
        assert isinstance(engine, TransformersEngine)
        plan = next(e for e in await client.wait_ready() if e.phase == stage_pb2.MEMORY_PLANNED)
        budget = engine.runner.budget
        assert (budget.pages, budget.page_size) == (plan.memory.cache_pages, plan.memory.page_size)
        rows: list[int] = []
        # Each forward, the model's own or the lean one, calls the first layer's
        # output projection with [rows, columns, features].
        projection = engine.model.model.layers[0].self_attn.o_proj
        handle = projection.register_forward_pre_hook(
            lambda _m, args: rows.append(int(args[0].shape[0]))
        )
        try:
            prompts = ["Hi", "What is two plus two?", "Name a colour.", "Count to three."]
            results = await run_all(
                client, [chat(f"q{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
            )
        finally:
            handle.remove()
        assert sorted(results) == ["q0", "q1", "q2", "q3"]
        for result in results.values():
            assert result.error is None and result.completed is not None
            assert len(result.token_ids) == result.completed.usage.completion_tokens > 0
        assert max(rows) == 4  # the four requests ran in shared forward passes
    finally:
        await client.close()
        await server.stop(1.0)


async def test_queue_ms_counts_the_wait_for_a_place_in_the_batch(
    omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    config = tiny_config("one-at-a-time", omni_cache_dir, runtime={"max_batch_size": 1})
    server, client = await start(config)
    try:
        results = await run_all(
            client, [chat(f"w{i}", "Tell me a story.", max_tokens=48) for i in range(2)]
        )
    finally:
        await client.close()
        await server.stop(1.0)
    done = [r.completed for r in results.values()]
    assert all(d is not None for d in done)
    first, second = sorted(done, key=lambda d: d.timings.queue_ms)
    assert first is not None and second is not None
    # One request at a time: the second waited in the engine while the first ran.
    assert second.timings.queue_ms >= 0.5 * first.timings.total_ms
    assert second.timings.total_ms > second.timings.queue_ms


async def test_a_prompt_beyond_the_kv_plan_is_refused_through_the_stream(
    omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    config = tiny_config("small-kv", omni_cache_dir, runtime={"page_size": 4})
    server, client = await start(config)
    try:
        engine = server.runtime.engine
        assert isinstance(engine, TransformersEngine)
        engine.plan_kv_cache(2, 4)  # as a stage with little memory would have planned
        results = await run_all(client, [chat("big", "What is the capital of France?")])
    finally:
        await client.close()
        await server.stop(1.0)
    error = results["big"].error
    assert error is not None and error.code_name == "INVALID_ARGUMENT"
    assert error.field == "inputs.messages"
    assert (
        "can never fit the stage's KV cache, which holds 8 tokens (2 x 4-token pages)"
        in error.message
    )
