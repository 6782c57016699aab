"""A stage that dies fails its in-flight requests at once, naming it; the
orchestrator reconnects and its health follows."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.processes import StageProcess
from orchestrator.client import Result
from orchestrator.server.pipeline import parse_pipeline
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.rpc.stage_client import KEEPALIVE_S
from services.testing.configs import tiny_config, write_config
from tests.helpers.polling import eventually
from tests.orchestrator.conftest import orchestrator


async def orchestrator_health(client) -> int:
    stub = health_pb2_grpc.HealthStub(client.channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service="omni.v1.Orchestrator"))
    return reply.status


async def wait_for(predicate, timeout_s: float) -> None:
    await eventually(predicate, timeout_s)


async def test_killed_stage_fails_requests_then_comes_back(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    config_file = write_config(
        tmp_path / "solo.yaml",
        tiny_config("solo", omni_cache_dir, runtime={"torch_threads": 1}),
    )
    first = StageProcess(config_file)
    address = await first.start()
    port = address.rsplit(":", 1)[1]
    second = None
    # A request for the stage while it is down waits a second for it, then is refused.
    pipeline = parse_pipeline(
        {
            "name": "loss",
            "stages": [{"name": "solo", "address": address}],
            "runtime": {"ready_wait_s": 1},
        },
        "loss.yaml",
    )
    try:
        async with orchestrator(pipeline) as (_server, client):
            stream = client.generate("Tell me more", params={"max_tokens": 5000}).__aiter__()
            result = Result()
            while not result.stages:
                result.add(await stream.__anext__())
            killed_at = time.monotonic()
            first._proc.kill()  # no drain: the process is simply gone
            async for event in stream:
                result.add(event)
            failed_after = time.monotonic() - killed_at
            assert result.done.code_name == "UNAVAILABLE" and result.done.stage == "solo"
            assert "solo" in result.done.message and address in result.done.message
            # From the closed connection, before a keepalive ping could even be sent.
            assert failed_after < KEEPALIVE_S

            async def down() -> bool:
                return (
                    await orchestrator_health(client) == health_pb2.HealthCheckResponse.NOT_SERVING
                )

            await wait_for(down, 10)
            (status,) = await client.list_stages()
            assert status.state in (orchestrator_pb2.STAGE_DOWN, orchestrator_pb2.STAGE_STARTING)
            refused = await client.generate("Hi", params={"max_tokens": 2}).collect()
            assert refused.done.code_name == "UNAVAILABLE" and refused.done.stage == "solo"
            assert "stage solo is not ready after waiting 1.0s: STAGE_" in refused.done.message
            second = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.stage",
                "serve",
                "--config",
                str(config_file),
                "--port",
                port,
                stdout=asyncio.subprocess.PIPE,
            )

            async def up() -> bool:
                return await orchestrator_health(client) == health_pb2.HealthCheckResponse.SERVING

            await wait_for(up, 60)
            assert (await client.generate("Hi", params={"max_tokens": 2}).collect()).ok
    finally:
        await first.stop(1)
        if second is not None:
            second.terminate()
            await second.wait()
