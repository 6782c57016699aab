"""The Stage service over a real gRPC channel, serving the real SmolLM2."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import kernels
from services.engines.transformers import TransformersEngine
from services.engines.transformers.loading import kernels_refuse
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from services.stage.config import parse_stage_config
from services.stage.server import LIVENESS_SERVICE, STAGE_SERVICE, StageServer
from services.testing.configs import stage_config
from tests.helpers.stage import Result, cancel, chat, collect, record

CAPITAL = "What is the capital of France?"


@pytest.fixture(scope="module")
async def stage(omni_cache_dir: Path, smollm2_gguf: Path):
    config = stage_config(
        "thinker",
        omni_cache_dir,
        runtime={"max_prompt_tokens": 64, "max_message_bytes": 64 * 1024},
    )
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=300)
        yield server, client
    await server.stop(1.0)


async def health_of(client: StageClient, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(client.channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return reply.status


async def test_init_status_replays_every_phase_with_a_memory_plan(stage) -> None:
    _server, client = stage
    events = [e async for e in client.init_events()]
    phases = [stage_pb2.InitPhase.Name(e.phase) for e in events]
    # PREPARE (the GGUF's one-time conversion) only where no stage converted it before
    # on this machine (tests/stage/startup/test_startup_events.py holds that step).
    converted = ["PREPARE"] if "PREPARE" in phases else []
    assert phases == [
        "STARTING",
        "DOWNLOAD_START",
        "DOWNLOAD_DONE",
        *converted,
        "LOAD_START",
        "LOAD_DONE",
        "MEMORY_PLANNED",
        "WARMUP",
        "READY",
    ]
    done = events[2]
    assert done.cache_hit and done.bytes_done > 90_000_000  # the GGUF in the package
    plan = events[phases.index("MEMORY_PLANNED")].memory
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32, 16-token pages.
    assert plan.bytes_per_page == 2 * 64 * 3 * 16 * 4 * 30
    # The linears on the GGUF's own blocks plus the float32 embeddings (113 MB) where
    # the kernels run here; all float32 (the tied head packed apart) where they do not.
    if kernels_refuse() is None:
        assert 180_000_000 < plan.model_bytes < 260_000_000
    else:
        assert 600_000_000 < plan.model_bytes < 700_000_000
    expected = (int(plan.free_before_bytes * plan.memory_ratio) - plan.model_bytes) // (
        plan.bytes_per_page
    )
    assert plan.cache_pages == expected and plan.memory_ratio == pytest.approx(0.88)
    assert all(e.stage == "thinker" for e in events)
    assert [e.monotonic_s for e in events] == sorted(e.monotonic_s for e in events)


async def test_health_is_serving_once_ready(stage) -> None:
    _server, client = stage
    assert await health_of(client, STAGE_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert await health_of(client, LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING


async def test_answers_in_ordered_segments(stage, smollm2_reference) -> None:
    _server, client = stage
    call = client.open_stream()
    await call.write(chat("paris", CAPITAL, max_tokens=12))
    await call.done_writing()
    results = await collect(call)
    result = results["paris"]
    smollm2_reference.answer(CAPITAL, 12).assert_said(result.token_ids)
    assert [s.sequence for s in result.segments] == list(range(len(result.segments)))
    assert [s.is_last for s in result.segments] == [False] * (len(result.segments) - 1) + [True]
    assert all(len(s.token_ids) <= 4 for s in result.segments)  # max_segment_tokens
    assert result.completed is not None and result.error is None
    assert result.completed.usage.completion_tokens == len(result.token_ids)
    assert result.completed.timings.total_ms >= result.completed.timings.time_to_first_ms > 0


async def test_several_requests_share_one_stream(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    prompts = {"a": CAPITAL, "b": "Name a colour.", "c": "Say hello."}
    for rid, prompt in prompts.items():
        await call.write(chat(rid, prompt, max_tokens=6))
    await call.done_writing()
    results = await collect(call)
    assert set(results) == set(prompts)
    for result in results.values():
        assert result.completed is not None and result.segments[-1].is_last


@pytest.mark.parametrize(
    ("submit", "code", "field"),
    [
        (chat("", CAPITAL), "INVALID_ARGUMENT", "submit.request_id"),
        (chat("neg", CAPITAL, max_tokens=-1), "INVALID_ARGUMENT", "params.max_tokens"),
        (chat("huge", CAPITAL, max_tokens=10**9), "INVALID_ARGUMENT", "params.max_tokens"),
        (
            chat("steps", CAPITAL, num_inference_steps=4),
            "INVALID_ARGUMENT",
            "params.num_inference_steps",
        ),
        (chat("long", "word " * 200), "INVALID_ARGUMENT", "inputs.messages"),
        (chat("big", "x" * 70_000), "RESOURCE_EXHAUSTED", "submit"),
    ],
)
async def test_bad_input_ends_only_that_request(stage, submit, code, field) -> None:
    _server, client = stage
    call = client.open_stream()
    await call.write(submit)
    await call.write(chat("good", CAPITAL, max_tokens=3))
    await call.done_writing()
    results = await collect(call)
    bad = results[submit.submit.request_id]
    assert bad.error is not None and bad.error.code_name == code
    assert bad.error.field == field and field in bad.error.message
    assert bad.segments == []
    assert results["good"].completed is not None


async def test_tensor_whose_bytes_disagree_with_its_shape_is_refused(stage) -> None:
    _server, client = stage
    bad = chat("t", CAPITAL)
    bad.submit.inputs.tensors.append(
        tensor_pb2.Tensor(name="prompt_embeds", dtype="float32", shape=[2, 576], raw=b"\0" * 12)
    )
    results = await collect(client.generate(bad.submit))
    error = results["t"].error
    assert error is not None and error.code_name == "INVALID_ARGUMENT"
    assert error.field == "inputs.tensors[0].raw" and "need 4608 bytes, got 12" in error.message


async def test_duplicate_in_flight_request_id_is_refused(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    await call.write(chat("dup", CAPITAL, max_tokens=8))
    await call.write(chat("dup", CAPITAL, max_tokens=8))
    await call.done_writing()
    result = (await collect(call))["dup"]
    assert result.error is not None and result.error.field == "submit.request_id"
    assert result.completed is None  # one final event for the id


async def test_queue_beyond_its_bound_is_resource_exhausted(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    for i in range(5):  # 2 running + 2 queued + 1 refused
        await call.write(chat(f"q{i}", CAPITAL, max_tokens=4))
    await call.done_writing()
    results = await collect(call)
    refused = [rid for rid, r in results.items() if r.error is not None]
    assert refused == ["q4"]
    error = results["q4"].error
    assert error is not None
    assert (error.code_name, error.field) == ("RESOURCE_EXHAUSTED", "request_id")
    # The stage's own settings, as configured (max_batch_size 2, max_queue_size 2).
    assert error.message == (
        "request q4: stage thinker is full: 4 requests, up to 2 running "
        "(runtime.max_batch_size) and 2 waiting (runtime.max_queue_size)"
    )
    assert all(results[f"q{i}"].completed is not None for i in range(4))


async def test_a_request_is_templated_and_tokenized_once(
    stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = stage
    engine = server.runtime.engine
    assert isinstance(engine, TransformersEngine)
    tokenizer = engine.tokenizer  # the real SmolLM2 tokenizer the engine plans with
    real = tokenizer.apply_chat_template
    calls: list[object] = []

    def counted(conversation: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(conversation)
        return real(conversation, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counted)  # this instance only
    results = await collect(client.generate(chat("once", CAPITAL, max_tokens=4).submit))
    completed = results["once"].completed
    assert completed is not None and completed.usage.prompt_tokens > 0
    assert len(calls) == 1  # checked at intake, and that plan is what ran


async def test_cancel_stops_a_generation_and_frees_its_slot(stage) -> None:
    server, client = stage
    call = client.open_stream()
    await call.write(chat("long", "Write a long story about a dragon.", max_tokens=400))
    results: dict[str, Result] = defaultdict(Result)
    while record(results, await call.read()) != "long" or not results["long"].segments:
        pass
    await call.write(cancel("long"))
    await call.write(chat("after", CAPITAL, max_tokens=3))
    await call.done_writing()
    await collect(call, results)
    long = results["long"]
    assert long.error is not None and long.error.code_name == "CANCELLED"
    assert len(long.token_ids) < 100
    assert results["after"].completed is not None
    assert server.runtime.in_flight == 0


async def test_abort_rpc_reaches_a_request_on_another_stream(stage) -> None:
    server, client = stage
    call = client.open_stream()
    await call.write(chat("victim", "Count from one to two hundred.", max_tokens=400))
    first = await call.read()
    assert first.WhichOneof("kind") == "segment"
    reply = await client.abort("victim", "nobody")
    assert list(reply.aborted) == ["victim"] and list(reply.not_found) == ["nobody"]
    await call.done_writing()
    results = await collect(call)
    assert results["victim"].error.code_name == "CANCELLED"
    assert server.runtime.in_flight == 0


async def test_client_disconnect_cancels_its_requests(stage) -> None:
    server, client = stage
    call = client.open_stream()
    await call.write(chat("gone", "Tell me everything about Rome.", max_tokens=400))
    await call.read()
    assert server.runtime.in_flight == 1
    call.cancel()
    await asyncio.wait_for(server.runtime.requests.wait_idle(), 5)
    assert server.runtime.in_flight == 0


async def test_hidden_states_come_as_a_tensor_per_segment(stage) -> None:
    _server, client = stage
    submit = chat("h", CAPITAL, max_tokens=6, return_hidden_states=True).submit
    result = (await collect(client.generate(submit)))["h"]
    rows = 0
    for segment in result.segments:
        if not segment.token_ids:
            continue
        (tensor,) = segment.tensors
        hidden = codec.from_proto(tensor)
        assert tensor.name == "hidden_states" and hidden.dtype == torch.float32
        assert hidden.shape == (len(segment.token_ids), 576)
        rows += hidden.shape[0]
    assert rows == len(result.token_ids) == 6


async def test_windowed_input_is_joined_before_generation(stage, smollm2_reference) -> None:
    _server, client = stage
    call = client.open_stream()
    for seq, (text, last) in enumerate([("What is the capital", False), (" of France?", True)]):
        submit = chat("w", text, max_tokens=10).submit
        submit.sequence, submit.is_last = seq, last
        await call.write(stage_pb2.StageInput(submit=submit))
    await call.done_writing()
    # The answer to the whole question: the windows were joined before the prompt.
    smollm2_reference.answer(CAPITAL, 10).assert_said((await collect(call))["w"].token_ids)


async def test_describe_names_the_engine_and_its_parameters(stage) -> None:
    _server, client = stage
    info = await client.describe()
    assert info.name == "thinker" and info.engine == "transformers"
    assert info.phase == stage_pb2.READY and "max_tokens" in info.supported_params
    assert list(info.output_tensors) == ["hidden_states"] and info.node.hostname
    needs = {t.name: list(t.needs_tensors) for t in info.transforms}
    assert needs == {"text": [], "tokens": [], "hidden_states_to_prompt_embeds": ["hidden_states"]}
    # How it computes: the SmolLM2 GGUF on the kernels' best variant here, or float32
    # on the reference runner where they cannot run it (the same function decides).
    if kernels_refuse() is None:
        assert info.compute.startswith("llama_cpu runner, 211 linears on GGUF blocks")
        assert f"kernels {kernels.variant()} (" in info.compute
    else:
        assert info.compute == "reference runner, 211 packed for oneDNN"


async def test_the_stream_outlives_a_request_error_and_grpc_status_is_ok(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    await call.write(chat("", CAPITAL))
    await call.done_writing()
    outputs = [o async for o in call]
    assert len(outputs) == 1
    assert await call.code() == grpc.StatusCode.OK
