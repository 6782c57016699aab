"""Keepalive and deadlines against a real stage process: a stopped (SIGSTOP)
stage is noticed by a direct client, and a client's deadline reaches the stages."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrator.cli.processes import StageProcess
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.requests.client_input import single
from orchestrator.server.requests.sink import EventSink
from orchestrator.server.server import OrchestratorServer
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.testing.configs import tiny_config, write_config


@pytest.fixture(scope="module")
async def stage(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path
) -> AsyncIterator[StageProcess]:
    folder = tmp_path_factory.mktemp("deadlines")
    config = tiny_config("thinker", omni_cache_dir, runtime={"torch_threads": 1})
    process = StageProcess(write_config(folder / "thinker.yaml", config))
    address = await process.start()
    try:
        async with StageClient(address) as client:
            await client.wait_ready(timeout_s=180)
        yield process
    finally:
        os.kill(process.pid, signal.SIGCONT)
        await process.stop(5)


async def test_a_stopped_stage_is_noticed_by_a_direct_client(stage: StageProcess) -> None:
    async with StageClient(stage.address, keepalive_s=1.0) as client:
        outputs = client.generate(chat_submit("long", "Write at length.", max_tokens=3000))
        first = await anext(outputs)
        assert first.WhichOneof("kind") == "segment"
        os.kill(stage.pid, signal.SIGSTOP)
        began = time.monotonic()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                async with asyncio.timeout(30):
                    async for _ in outputs:
                        pass
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - began < 15  # ~ keepalive interval + ping timeout
        finally:
            os.kill(stage.pid, signal.SIGCONT)
    # Resumed, the stage serves again.
    async with StageClient(stage.address) as client:
        outputs = [o async for o in client.generate(chat_submit("after", "Hi", max_tokens=2))]
        assert outputs[-1].WhichOneof("kind") == "completed"


async def test_a_client_deadline_reaches_the_stage(stage: StageProcess) -> None:
    pipeline = parse_pipeline(
        {"name": "p", "stages": [{"name": "thinker", "address": stage.address}]}, "p.yaml"
    )
    server = OrchestratorServer(pipeline)
    await server.start("127.0.0.1", 0)
    try:
        await server.wait_ready(60)
        sink = EventSink(1024, 256)
        submit = chat_submit("deadline", "Write at length.", max_tokens=3000)
        began = time.monotonic()
        # The router as the servicer drives it, with 1.5 s left of the client's deadline.
        server.router.start("deadline", single(submit), {}, sink, timeout_s=1.5)
        events = []
        while (event := await sink.get()) is not None:
            events.append(event)
            if event.WhichOneof("kind") == "done":
                break
        done = events[-1].done
        # The stage call itself ran out of time: the stage was told the deadline.
        assert done.code_name == "DEADLINE_EXCEEDED" and done.stage == "thinker", done
        assert 1.4 < time.monotonic() - began < 10
        assert any(e.WhichOneof("kind") == "segment" for e in events)
    finally:
        await server.stop(1.0)
