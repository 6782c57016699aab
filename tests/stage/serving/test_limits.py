"""Hostile prompts against a real stage process: refused at once by their size,
while health answers and the requests already running finish whole."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config, write_config
from tests.helpers.stage import chat, collect

MAX_MESSAGE = 64 << 20  # the stage's default runtime.max_message_bytes
RUNNING_TOKENS = 200


def proc_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise AssertionError(f"{key} missing from /proc/{pid}/status")


def submit(rid: str, **inputs: object) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(
        submit=stage_pb2.Submit(
            request_id=rid, inputs=stage_pb2.StageInputs(**inputs), is_last=True
        )
    )


HOSTILE = {  # request id: the field it must be refused on
    "text-40mb": "inputs.text",
    "text-64mib": "inputs.text",
    "messages-40mb": "inputs.messages",
    "ids-8m": "inputs.token_ids",
}


def hostile(rid: str) -> stage_pb2.StageInput:
    """Built one at a time: together they would take the test process gigabytes."""
    if rid == "text-40mb":
        return submit(rid, text="x" * (40 << 20))
    if rid == "text-64mib":  # just under the stage's message limit
        return submit(rid, text="word " * ((MAX_MESSAGE - (64 << 10)) // 5))
    if rid == "messages-40mb":
        messages = [
            stage_pb2.ChatMessage(role="user", content="hi " * (7 << 20)),
            stage_pb2.ChatMessage(role="assistant", content="ok " * (7 << 20)),
        ]
        return submit(rid, messages=messages)
    return submit(rid, token_ids=[1] * (8 << 20))


@pytest.fixture
async def stage(tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path):
    config = tiny_config(
        "limits", omni_cache_dir, runtime={"max_batch_size": 4, "max_queue_size": 8}
    )
    process = StageProcess(write_config(tmp_path / "limits.yaml", config))
    address = await process.start()
    yield process, address
    await process.stop()


async def test_hostile_prompts_are_refused_by_size_while_health_and_running_requests_go_on(
    stage,
) -> None:
    process, address = stage
    async with StageClient(address) as client:
        await client.wait_ready(timeout_s=120)
        health = health_pb2_grpc.HealthStub(client.channel)
        # Ordinary requests, each on its own stream, running before the hostile ones come.
        calls = []
        for i in range(3):
            call = client.open_stream()
            prompt = f"Count to ten, take {i}."
            await call.write(chat(f"ok-{i}", prompt, max_tokens=RUNNING_TOKENS, temperature=0.0))
            await call.done_writing()
            calls.append(call)
        firsts = [await call.read() for call in calls]
        assert all(first.WhichOneof("kind") == "segment" for first in firsts)
        rss_before = proc_kib(process.pid, "VmRSS")

        probing = True
        answers: list[tuple[int, float]] = []

        async def probe() -> None:
            while probing:
                began = time.monotonic()
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service="omni.v1.Stage"), timeout=2.0
                )
                answers.append((reply.status, time.monotonic() - began))
                await asyncio.sleep(0.05)

        prober = asyncio.create_task(probe())
        refused: dict[str, stage_pb2.Error] = {}
        took: dict[str, float] = {}
        for rid in HOSTILE:
            message = hostile(rid)
            began = time.monotonic()
            call = client.open_stream()
            await call.write(message)
            await call.done_writing()
            result = (await collect(call))[rid]
            took[rid] = time.monotonic() - began
            assert result.error is not None, f"{rid}: {result}"
            refused[rid] = result.error
            del message, call, result
        probing = False
        await prober  # a Check past its deadline raises here and fails the test
        peak = proc_kib(process.pid, "VmHWM")

        results = [await collect(call) for call in calls]

    for rid, field in HOSTILE.items():
        error = refused[rid]
        assert (error.code_name, error.field) == ("INVALID_ARGUMENT", field), error
        assert "4096" in error.message and "max_prompt_tokens" in error.message
        # Refused by its size, not after tokenizing it (tens of seconds for 40 MB).
        assert took[rid] < 10.0, took
    assert answers and all(
        status == health_pb2.HealthCheckResponse.SERVING for status, _ in answers
    )
    for i, (first, result) in enumerate(zip(firsts, results, strict=True)):
        done = result[f"ok-{i}"]
        assert done.error is None and done.completed is not None
        tokens = list(first.segment.token_ids) + done.token_ids
        assert len(tokens) == done.completed.usage.completion_tokens
        assert done.completed.finish_reason == "length" and len(tokens) == RUNNING_TOKENS
    # The stage held the messages it was sent, never a tokenization of them.
    assert (peak - rss_before) < 500 << 10, (rss_before, peak)


async def test_a_submit_over_the_message_limit_ends_its_request_and_the_stream_goes_on(
    stage,
) -> None:
    _process, address = stage
    async with StageClient(address) as client:
        await client.wait_ready(timeout_s=120)
        call = client.open_stream()
        await call.write(chat("before", "Hello", max_tokens=4))
        huge = submit("huge", text="x" * 200_000_000)  # 200 MB: three times the limit
        await call.write(huge)
        del huge
        await call.write(chat("after", "Hello", max_tokens=4))
        await call.done_writing()
        results = await collect(call)  # the stream ended as streams end: no RPC error
    error = results["huge"].error
    assert error is not None and (error.code_name, error.field) == ("RESOURCE_EXHAUSTED", "submit")
    assert f"at most {MAX_MESSAGE} (runtime.max_message_bytes)" in error.message
    for rid in ("before", "after"):
        done = results[rid]
        assert done.completed is not None and len(done.token_ids) == 4, (rid, done)


async def test_a_prompt_under_the_bound_but_over_the_token_limit_is_still_refused(stage) -> None:
    _process, address = stage
    async with StageClient(address) as client:
        await client.wait_ready(timeout_s=120)
        call = client.open_stream()
        # 5,000 words: well under the character bound, over 4,096 tokens once tokenized.
        await call.write(submit("long", text=" word" * 5000))
        await call.write(chat("fine", "Hello", max_tokens=4))
        await call.done_writing()
        results = await collect(call)
    error = results["long"].error
    assert error is not None and error.code_name == "INVALID_ARGUMENT"
    assert error.field == "inputs.text" and "5000 tokens, the limit is 4096" in error.message
    assert results["fine"].completed is not None and len(results["fine"].token_ids) == 4
    assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == error.code


@pytest.fixture
async def roomy_stage(tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path):
    """In this process, with a token limit so high that a long text is tokenized."""
    runtime = {"max_batch_size": 2, "max_prompt_tokens": 4_000_000}
    server = StageServer(parse_stage_config(tiny_config("roomy", omni_cache_dir, runtime=runtime)))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=120)
        yield client
    await server.stop(1.0)


async def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(roomy_stage) -> None:
    client = roomy_stage
    health = health_pb2_grpc.HealthStub(client.channel)
    running = client.open_stream()
    await running.write(chat("ok", "Count to ten.", max_tokens=RUNNING_TOKENS, temperature=0.0))
    await running.done_writing()
    assert (await running.read()).WhichOneof("kind") == "segment"
    call = client.open_stream()
    # Seconds of tokenizing (a million tokens), then refused: the model's context is shorter.
    await call.write(submit("long", text=" word" * 1_000_000))
    await call.done_writing()
    refused = asyncio.create_task(collect(call))
    answered = 0
    while not refused.done():
        # The stage shares this event loop: a blocked loop would miss these deadlines.
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service="omni.v1.Stage"), timeout=1.0
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        answered += 1
        await asyncio.wait({refused}, timeout=0.1)
    error = (await refused)["long"].error
    assert error is not None and error.field == "inputs.text"
    assert "1000000 tokens, the model's context is" in error.message
    assert answered >= 3  # the check was answered again and again while it tokenized
    done = (await collect(running))["ok"]
    assert done.completed is not None and done.completed.usage.completion_tokens == RUNNING_TOKENS
