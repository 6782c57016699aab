"""A dead engine is fatal for the stage: FAILED, NOT_SERVING, every request in
flight UNAVAILABLE, and the process exits non-zero so it is restarted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.__main__ import EXIT_ENGINE_DEAD
from services.stage.config import parse_stage_config
from services.stage.server import LIVENESS_SERVICE, STAGE_SERVICE, StageServer
from services.testing.configs import write_config
from tests.helpers.stage import chat, collect

ROOT = Path(__file__).resolve().parents[2]
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def mortal_config(cache_dir: Path) -> dict[str, object]:
    return {
        "name": "mortal",
        "engine": "tests.helpers.engines:ScriptedEngine",  # the plug-in hook
        "load_format": "dummy",
        "cache_dir": str(cache_dir),
        "runtime": {"max_batch_size": 4, "drain_grace_s": 5},
        "segmenting": {"max_segment_tokens": 1, "min_flush_interval_ms": 0},
    }


async def first_segment(call) -> None:
    output = await call.read()
    assert output.WhichOneof("kind") == "segment", output


async def test_a_dead_engine_fails_the_stage_in_place(tmp_path: Path) -> None:
    server = StageServer(parse_stage_config(mortal_config(tmp_path)))
    port = await server.start("127.0.0.1", 0)
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=30)
            health = health_pb2_grpc.HealthStub(client.channel)
            held = client.open_stream()
            await held.write(chat("held", "hold"))
            await first_segment(held)
            victim = (await collect(client.generate(chat("victim", "die").submit)))["victim"]
            await asyncio.wait_for(server.failed.wait(), 10)
            await held.done_writing()
            bystander = (await collect(held))["held"]
            events = [e async for e in client.init_events()]
            ready = await health.Check(health_pb2.HealthCheckRequest(service=STAGE_SERVICE))
            alive = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
            after = (await collect(client.generate(chat("after", "hello").submit)))["after"]
    finally:
        await server.stop(1.0)
    assert victim.error.code_name == "UNAVAILABLE" and "died" in victim.error.message
    assert bystander.error.code_name == "UNAVAILABLE"  # in flight when it died
    assert [stage_pb2.InitPhase.Name(e.phase) for e in events[-2:]] == ["READY", "FAILED"]
    assert "the engine died" in events[-1].reason
    assert ready.status == NOT_SERVING and alive.status == NOT_SERVING
    assert after.error.code_name == "UNAVAILABLE" and "engine died" in after.error.message


@pytest.mark.slow
async def test_a_stage_process_whose_engine_dies_exits_non_zero(tmp_path: Path) -> None:
    log = (tmp_path / "stage.log").open("wb")
    config = write_config(tmp_path / "mortal.yaml", mortal_config(tmp_path))
    stage = StageProcess(config, log=log, env={"PYTHONPATH": str(ROOT)})
    try:
        address = await stage.start()
        async with StageClient(address) as client:
            await client.wait_ready(timeout_s=60)
            health = health_pb2_grpc.HealthStub(client.channel)
            # Watching from before the death: each sees SERVING, then NOT_SERVING.
            watches = [
                health.Watch(health_pb2.HealthCheckRequest(service=name))
                for name in (STAGE_SERVICE, LIVENESS_SERVICE)
            ]
            held = client.open_stream()
            await held.write(chat("held", "hold"))
            await first_segment(held)
            victim = (await collect(client.generate(chat("victim", "die").submit)))["victim"]
            await held.done_writing()
            bystander = (await collect(held))["held"]
            seen = [[(await w.read()).status, (await w.read()).status] for w in watches]
        code = await asyncio.wait_for(stage.wait(), 30)
    finally:
        await stage.stop(5)
        log.close()
    assert victim.error.code_name == "UNAVAILABLE"
    assert bystander.error.code_name == "UNAVAILABLE"
    assert seen == [[health_pb2.HealthCheckResponse.SERVING, NOT_SERVING]] * 2
    assert code == EXIT_ENGINE_DEAD
    assert "FAILED the engine died" in (tmp_path / "stage.log").read_text()
