"""What InitStatus says about each phase: durations of the phase an event
closes, and messages that describe the stage's state now."""

from __future__ import annotations

from pathlib import Path

from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.stage.startup.device_lock import DeviceLock


async def test_lock_acquired_and_ready_report_their_own_phase(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    neighbour = DeviceLock("cpu", "neighbour", locks)
    assert await neighbour.acquire(1.0) < 1.0
    config = {
        "name": "locked",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path / "cache"),
        "runtime": {"device_lock": True, "lock_dir": str(locks), "stage_init_timeout_s": 30},
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    events: list[stage_pb2.InitEvent] = []
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            async for event in client.init_events():
                events.append(event)
                if event.phase == stage_pb2.DEVICE_LOCK_WAIT:
                    neighbour.release()  # the stage waited; now it may go on
    finally:
        neighbour.release()
        await server.stop(1.0)
    by_phase = {stage_pb2.InitPhase.Name(e.phase): e for e in events}
    assert "waiting" in by_phase["DEVICE_LOCK_WAIT"].message
    acquired = by_phase["DEVICE_LOCK_ACQUIRED"]
    assert acquired.message.startswith("acquired device cpu after")
    assert "waiting" not in acquired.message
    ready, warmup = by_phase["READY"], by_phase["WARMUP"]
    # READY closes the warm-up: its duration is that phase's, not the whole start-up.
    assert ready.duration_ms <= (ready.monotonic_s - warmup.monotonic_s) * 1e3 + 1
    assert ready.duration_ms < (ready.monotonic_s - acquired.monotonic_s) * 1e3


async def start_and_follow(config: dict[str, object]) -> list[stage_pb2.InitEvent]:
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            return await client.wait_ready(timeout_s=300)
    finally:
        await server.stop(1.0)


async def test_a_one_time_conversion_is_its_own_step(tmp_path: Path, smollm2_gguf: Path) -> None:
    # A cache of its own: the GGUF is converted here, then found converted.
    config = {
        "name": "converting",
        "engine": "transformers",
        "model": str(smollm2_gguf),
        "cache_dir": str(tmp_path / "cache"),
        "engine_args": {"config_overrides": {"num_hidden_layers": 1}},
        "load_format": "dummy",
    }
    converting = await start_and_follow(config)
    first = [stage_pb2.InitPhase.Name(e.phase) for e in converting]
    again = [stage_pb2.InitPhase.Name(e.phase) for e in await start_and_follow(config)]
    assert first.index("DOWNLOAD_DONE") < first.index("PREPARE") < first.index("LOAD_START")
    prepare = converting[first.index("PREPARE")]
    assert prepare.message == f"converting {smollm2_gguf.name} to safetensors (once per file)"
    assert "PREPARE" not in again and "LOAD_START" in again
