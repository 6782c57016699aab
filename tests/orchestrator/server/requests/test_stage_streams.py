"""Requests share one long-lived Generate stream per stage: one slow request
pauses alone (per-request credit), a cancel or a deadline ends one request and
not the stream, and a killed stage fails the requests on its stream, which the
next request reopens. The stages are real servers; the in-process ones let the
test count the streams they were opened."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from orchestrator.cli.processes import StageProcess
from orchestrator.client import Result
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.requests.client_input import single
from orchestrator.server.requests.request_stream import CREDIT
from orchestrator.server.requests.sink import EventSink
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config, write_config
from tests.orchestrator.conftest import orchestrator
from tests.orchestrator.server.stages.test_stage_loss import orchestrator_health, wait_for

STAGES = ("thinker", "talker")


@pytest.fixture(scope="module")
async def stages(omni_cache_dir: Path, smollm2_gguf: Path):
    runtime = {"torch_threads": 1, "max_batch_size": 4, "max_queue_size": 16}
    configs = {name: tiny_config(name, omni_cache_dir, runtime=runtime) for name in STAGES}
    # Echoes each input window's tokens as it comes (a streaming decoder).
    configs["decoder"] = {
        "name": "decoder",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(omni_cache_dir),
        "segmenting": {"max_segment_tokens": 2, "min_flush_interval_ms": 0},
        "runtime": {**runtime, "streaming_input": True},
    }
    servers = {name: StageServer(parse_stage_config(c)) for name, c in configs.items()}
    addresses = {}
    try:
        for name, server in servers.items():
            addresses[name] = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
            async with StageClient(addresses[name]) as client:
                await client.wait_ready(timeout_s=300)
        yield servers, addresses
    finally:
        await asyncio.gather(*(s.stop(1.0) for s in servers.values()))


def chain(addresses: dict[str, str], to: str = "talker", outputs: tuple[str, ...] = STAGES):
    return parse_pipeline(
        {
            "name": "chain",
            "stages": [{"name": n, "address": addresses[n]} for n in ("thinker", to)],
            "edges": [{"from": "thinker", "to": to, "window": 4, "transform": "tokens"}],
            "outputs": list(outputs),
        },
        "chain.yaml",
    )


def opened(servers: dict[str, StageServer]) -> dict[str, int]:
    counts = {}
    for name in STAGES:
        server = servers[name]
        assert server.servicer is not None
        counts[name] = server.servicer.streams_opened
    return counts


async def until_done(sink: EventSink) -> Result:
    result = Result()
    while result.done is None:
        event = await sink.get()
        assert event is not None
        result.add(event)
    return result


def in_order(result: Result, stage: str) -> list[int]:
    """The stage's tokens, checked complete against its own count."""
    got = result.stages[stage]
    assert got.completed is not None
    assert len(got.token_ids) == got.completed.usage.completion_tokens
    return got.token_ids


async def test_concurrent_requests_share_one_stream_per_stage(stages) -> None:
    servers, addresses = stages
    before = opened(servers)
    async with orchestrator(chain(addresses)) as (server, client):
        for _ in range(2):  # two bursts: the second reuses the streams of the first
            results = await asyncio.gather(
                *(client.generate("Hi", params={"max_tokens": 8}).collect() for _ in range(6))
            )
            assert all(r.ok for r in results), [r.done for r in results]
            for result in results:
                assert len(in_order(result, "thinker")) == 8
                assert in_order(result, "talker")
        assert {n: c - before[n] for n, c in opened(servers).items()} == {
            "thinker": 1,
            "talker": 1,
        }
        assert server.router.streams.opened == {"thinker": 1, "talker": 1}


async def test_a_slow_request_pauses_alone_on_the_shared_stream(stages) -> None:
    servers, addresses = stages
    async with orchestrator(chain(addresses)) as (server, _client):
        router = server.router
        # A's client reads nothing after its first event: its sink fills and its flow
        # stops taking the thinker's outputs, so its credit on the thinker runs out.
        slow = EventSink(2, 1)
        router.start("A", single(chat_submit("A", "Write at length.", max_tokens=200)), {}, slow)
        first = await slow.get()
        assert first is not None and first.WhichOneof("kind") == "segment"
        thinker = servers["thinker"].runtime.requests
        a_id = router.stage_id("A")  # what the stages know A by

        async def paused() -> bool:
            record = thinker.live(a_id)
            return record is not None and record.credit is not None and record.credit.left == 0

        await wait_for(paused, 60)
        # B on the same stages and streams runs to its end meanwhile.
        fast = EventSink(1024, 256)
        router.start("B", single(chat_submit("B", "Hi", max_tokens=24)), {}, fast)
        b = await asyncio.wait_for(until_done(fast), 60)
        assert b.ok, b.done
        assert len(in_order(b, "thinker")) == 24 and in_order(b, "talker")
        # A is still paused: nothing of it piled up in the orchestrator meanwhile.
        record = thinker.live(a_id)
        assert record is not None and record.credit is not None and record.credit.left == 0
        assert len(slow) <= 2 + 1  # the sink's high watermark, and a progress/chunk at most
        assert "A" in router
        # Read A now: it resumes and ends with all its tokens, in order.
        a, sequences = Result(), []
        event: orchestrator_pb2.GenerateEvent | None = first
        while event is not None:
            if event.WhichOneof("kind") == "segment" and event.stage == "thinker":
                sequences.append(event.segment.sequence)
            a.add(event)
            event = None if a.done else await asyncio.wait_for(slow.get(), 120)
        assert a.ok, a.done
        assert sequences == list(range(len(sequences)))
        assert len(in_order(a, "thinker")) == 200 and in_order(a, "talker")
        # The pause above was the credit's: A had far more to send than that.
        assert CREDIT < len(sequences)
        assert server.router.streams.opened == {"thinker": 1, "talker": 1}


async def test_a_paused_streaming_input_request_does_not_stop_its_stream(stages) -> None:
    """The decoder takes A's windows as they come but A's client reads nothing: A
    pauses on the decoder with windows still arriving, and B goes through the
    same decoder stream meanwhile."""
    servers, addresses = stages
    config = chain(addresses, to="decoder", outputs=("decoder",))
    async with orchestrator(config) as (server, _client):
        router = server.router
        slow = EventSink(2, 1)
        router.start("A", single(chat_submit("A", "Write at length.", max_tokens=200)), {}, slow)
        thinker, decoder = servers["thinker"].runtime.requests, servers["decoder"].runtime.requests
        a_id = router.stage_id("A")

        async def paused() -> bool:
            record = decoder.live(a_id)
            # Every window of A has been sent on (the thinker is done with it).
            sent = thinker.live(a_id) is None
            return (
                sent
                and record is not None
                and record.credit is not None
                and (record.credit.left == 0)
            )

        await wait_for(paused, 60)
        fast = EventSink(1024, 256)
        router.start("B", single(chat_submit("B", "Hi", max_tokens=12)), {}, fast)
        b = await asyncio.wait_for(until_done(fast), 60)
        assert b.ok, b.done
        assert len(b.stages["decoder"].token_ids) == 12  # every token of B, echoed
        a = await asyncio.wait_for(until_done(slow), 120)
        assert a.ok, a.done
        assert len(a.stages["decoder"].token_ids) == 200


async def test_cancel_of_one_request_leaves_the_others_running(stages) -> None:
    servers, addresses = stages
    async with orchestrator(chain(addresses)) as (server, client):
        sinks = {rid: EventSink(1024, 256) for rid in ("A", "B", "C")}
        for rid, sink in sinks.items():
            submit = chat_submit(rid, "Write at length.", max_tokens=40 if rid != "B" else 3000)
            server.router.start(rid, single(submit), {}, sink)
        b_id = server.router.stage_id("B")  # what the stages know B by
        first = await sinks["B"].get()
        assert first is not None and first.WhichOneof("kind") == "segment"
        aborted = await client.abort("B")
        assert list(aborted.aborted) == ["B"]
        b = await asyncio.wait_for(until_done(sinks["B"]), 30)
        assert b.done is not None and b.done.code_name == "CANCELLED"
        for rid in ("A", "C"):
            result = await asyncio.wait_for(until_done(sinks[rid]), 120)
            assert result.ok, result.done
            assert len(in_order(result, "thinker")) == 40
        # The stages dropped B (the Cancel went on the shared stream) and the
        # stream itself goes on: the next request needs no new one.
        assert b_id is not None and servers["thinker"].runtime.requests.live(b_id) is None
        again = await client.generate("Hi", params={"max_tokens": 4}).collect()
        assert again.ok and server.router.streams.opened == {"thinker": 1, "talker": 1}


async def test_a_deadline_ends_its_request_alone(stages) -> None:
    _servers, addresses = stages
    async with orchestrator(chain(addresses)) as (server, _client):
        late, other = EventSink(1024, 256), EventSink(1024, 256)
        began = time.monotonic()
        submit = chat_submit("late", "Write at length.", max_tokens=3000)
        server.router.start("late", single(submit), {}, late, timeout_s=1.0)
        server.router.start("other", single(chat_submit("other", "Hi", max_tokens=30)), {}, other)
        result = await asyncio.wait_for(until_done(late), 30)
        assert result.done is not None and result.done.code_name == "DEADLINE_EXCEEDED"
        assert result.done.stage in ("thinker", "talker")
        assert 0.9 < time.monotonic() - began < 10
        ok = await asyncio.wait_for(until_done(other), 60)
        assert ok.ok and len(in_order(ok, "thinker")) == 30
        assert server.router.streams.opened == {"thinker": 1, "talker": 1}


async def test_a_killed_stage_fails_the_requests_on_its_stream_then_a_new_one_opens(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    runtime = {"torch_threads": 1, "max_batch_size": 4}
    config_file = write_config(
        tmp_path / "solo.yaml", tiny_config("solo", omni_cache_dir, runtime=runtime)
    )
    first = StageProcess(config_file)
    address = await first.start()
    second = None
    pipeline = parse_pipeline(
        {"name": "loss", "stages": [{"name": "solo", "address": address}]}, "loss.yaml"
    )
    try:
        async with orchestrator(pipeline) as (server, client):
            sinks = {rid: EventSink(1024, 256) for rid in ("A", "B")}
            for rid, sink in sinks.items():
                submit = chat_submit(rid, "Write at length.", max_tokens=5000)
                server.router.start(rid, single(submit), {}, sink)
            for sink in sinks.values():
                event = await sink.get()
                assert event is not None and event.WhichOneof("kind") == "segment"
            first._proc.kill()  # type: ignore[union-attr]  # no drain: simply gone
            for sink in sinks.values():
                result = await asyncio.wait_for(until_done(sink), 10)
                assert result.done is not None
                assert result.done.code_name == "UNAVAILABLE" and result.done.stage == "solo"
                assert "solo" in result.done.message

            async def down() -> bool:
                return (
                    await orchestrator_health(client) == health_pb2.HealthCheckResponse.NOT_SERVING
                )

            await wait_for(down, 10)
            second = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.stage",
                "serve",
                "--config",
                str(config_file),
                "--port",
                address.rsplit(":", 1)[1],
                stdout=asyncio.subprocess.DEVNULL,
            )

            async def up() -> bool:
                return await orchestrator_health(client) == health_pb2.HealthCheckResponse.SERVING

            await wait_for(up, 120)
            again = await client.generate("Hi", params={"max_tokens": 3}).collect()
            assert again.ok, again.done
            assert server.router.streams.opened == {"solo": 2}  # reopened once
            assert again.stages["solo"].token_ids
    finally:
        await first.stop(1)
        if second is not None:
            second.terminate()
            await second.wait()
