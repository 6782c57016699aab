"""A stage as the operator runs it: its own process, probed with grpcurl."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.startup.device_lock import DeviceLock
from services.testing.configs import stage_config, tiny_config, write_config
from tests.helpers.grpcurl import grpcurl, health, json_stream
from tests.helpers.http_server import FileServer
from tests.helpers.lock_holder import lock_held
from tests.helpers.models import tar_folder, tiny_llama_folder
from tests.helpers.stage import chat, collect

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def check_health(client: StageClient, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(client.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


@pytest.fixture
async def tiny_stage(tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path):
    config = write_config(
        tmp_path / "tiny.yaml", tiny_config("tiny", omni_cache_dir, runtime={"drain_grace_s": 30})
    )
    stage = StageProcess(config)
    address = await stage.start()
    yield stage, address
    await stage.stop()


async def test_grpcurl_lists_probes_and_follows_init_status(tiny_stage) -> None:
    _stage, address = tiny_stage
    async with StageClient(address) as client:
        await client.wait_ready(timeout_s=120)
    services = await asyncio.to_thread(grpcurl, address, "list")
    assert "omni.v1.Stage" in services.split() and "grpc.health.v1.Health" in services.split()
    assert await asyncio.to_thread(health, address, "omni.v1.Stage") == "SERVING"
    assert await asyncio.to_thread(health, address, "liveness") == "SERVING"
    stream = await asyncio.to_thread(grpcurl, address, "omni.v1.Stage/InitStatus")
    phases = [event["phase"] for event in json_stream(stream)]
    assert phases[0] == "STARTING" and phases[-1] == "READY" and "MEMORY_PLANNED" in phases


async def test_sigterm_drains_in_flight_requests_and_exits_zero(tiny_stage) -> None:
    stage, address = tiny_stage
    async with StageClient(address) as client:
        await client.wait_ready(timeout_s=120)
        call = client.open_stream()
        await call.write(chat("drain", "Hello", max_tokens=300, temperature=1.0, seed=1))
        first = await call.read()
        assert first.WhichOneof("kind") == "segment"
        readiness = health_pb2_grpc.HealthStub(client.channel).Watch(
            health_pb2.HealthCheckRequest(service="omni.v1.Stage")
        )
        assert (await readiness.read()).status == SERVING
        stopping = asyncio.create_task(stage.stop(grace_s=30))
        assert (await readiness.read()).status == NOT_SERVING  # it drains from here on
        refused = client.open_stream()  # a new request while draining is refused
        await refused.write(chat("late", "Hello"))
        await refused.done_writing()
        late = (await collect(refused))["late"]
        await call.done_writing()
        result = await collect(call)
    assert late.error is not None and late.error.code_name == "UNAVAILABLE"
    assert "draining" in late.error.message
    assert result["drain"].completed is not None  # finished, not cut off
    assert result["drain"].completed.usage.completion_tokens == 300
    assert await stopping == 0


def test_bad_stage_file_exits_two_naming_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nengine: transformers\nmodel: m\nruntime:\n  max_batch_size: lots\n")
    done = subprocess.run(
        [sys.executable, "-m", "services.stage", "serve", "--config", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"{path}: runtime.max_batch_size: Input should be a valid integer" in done.stderr


async def test_a_model_that_fails_to_load_reports_failed(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": "many"}')
    config = {"name": "broken", "engine": "transformers", "model": str(broken)}
    stage = StageProcess(write_config(tmp_path / "broken.yaml", config))
    address = await stage.start()
    try:
        async with StageClient(address) as client:
            events = [e async for e in client.init_events()]
            assert events[-1].phase == stage_pb2.FAILED and events[-1].reason
            assert await check_health(client, "omni.v1.Stage") == NOT_SERVING
            assert await check_health(client, "liveness") == NOT_SERVING
            result = (await collect(client.generate(chat("x", "hi").submit)))["x"]
            assert result.error.code_name == "UNAVAILABLE" and "not ready" in result.error.message
    finally:
        assert await stage.stop() == 0


async def test_a_model_source_that_is_no_model_fails_start_up_in_one_line(tmp_path: Path) -> None:
    config = {"name": "passwd", "engine": "transformers", "model": "/etc/passwd"}
    log_path = tmp_path / "passwd.log"
    with log_path.open("ab") as log:
        stage = StageProcess(write_config(tmp_path / "passwd.yaml", config), log=log)
        address = await stage.start()
        try:
            async with StageClient(address) as client:
                events = [e async for e in client.init_events()]
        finally:
            assert await stage.stop() == 0
    failed = events[-1]
    assert failed.phase == stage_pb2.FAILED
    assert failed.reason == (
        "model: /etc/passwd is neither a Hugging Face model folder (with config.json) "
        "nor a .gguf file"
    )
    logged = log_path.read_text()
    assert f"FAILED {failed.reason}" in logged
    assert "Traceback" not in logged and "Error" not in logged


async def test_slow_http_model_download_reports_byte_progress(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    folder = await asyncio.to_thread(
        tiny_llama_folder, tmp_path / "tiny-llama", smollm2_gguf, omni_cache_dir
    )
    site = tmp_path / "site"
    site.mkdir()
    archive = tar_folder(folder, site / "tiny-llama.tar.gz")
    with FileServer(site, rate_bps=archive.stat().st_size // 2) as server:  # ~2 s
        config = stage_config("remote", tmp_path / "cache", model=server.url(archive.name))
        stage = StageProcess(write_config(tmp_path / "remote.yaml", config))
        address = await stage.start()
        try:
            async with StageClient(address) as client:
                events = await client.wait_ready(timeout_s=120)
                answer = await collect(client.generate(chat("r", "hi", max_tokens=3).submit))
        finally:
            assert await stage.stop() == 0
    progress = [e for e in events if e.phase == stage_pb2.DOWNLOAD_PROGRESS]
    assert len(progress) >= 3
    assert all(e.bytes_total == archive.stat().st_size for e in progress)
    assert [e.bytes_done for e in progress] == sorted(e.bytes_done for e in progress)
    done = next(e for e in events if e.phase == stage_pb2.DOWNLOAD_DONE)
    assert not done.cache_hit and done.duration_ms > 1000
    assert answer["r"].completed.usage.completion_tokens == 3


async def test_device_lock_held_by_another_process_times_out_naming_it(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    locks = tmp_path / "locks"
    async with lock_held(locks) as holder_pid:
        runtime = {"device_lock": True, "lock_dir": str(locks), "stage_init_timeout_s": 1.5}
        config = tiny_config("second", omni_cache_dir, runtime=runtime)
        stage = StageProcess(write_config(tmp_path / "second.yaml", config))
        address = await stage.start()
        async with StageClient(address) as client:
            events = [e async for e in client.init_events()]
        assert await stage.stop() == 0
    wait = next(e for e in events if e.phase == stage_pb2.DEVICE_LOCK_WAIT)
    assert "neighbour" in wait.holder and str(holder_pid) in wait.holder
    failed = events[-1]
    assert failed.phase == stage_pb2.FAILED
    assert "neighbour" in failed.reason and str(holder_pid) in failed.reason
    lock = DeviceLock("cpu", "me", locks)
    found_taken: list[str] = []
    await lock.acquire(1.0, on_wait=found_taken.append)
    assert found_taken == []  # free at the first try: the kernel released it with its holder
    lock.release()
