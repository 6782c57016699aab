"""A cache directory that cannot be used fails a stage's init naming the setting
it came from and the path, in words (issue 35: it was FileNotFoundError: [Errno 2]
from deep inside a conversion), before anything is fetched or loaded."""

from __future__ import annotations

from pathlib import Path

from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import tiny_config, write_config


async def failed_init(config: Path, env: dict[str, str] | None = None) -> stage_pb2.InitEvent:
    process = StageProcess(config, env=env)
    address = await process.start()
    try:
        async with StageClient(address) as client:
            events = [event async for event in client.init_events()]
    finally:
        await process.stop(5)
    assert events[-1].phase == stage_pb2.FAILED, events
    assert stage_pb2.LOAD_START not in [e.phase for e in events]
    return events[-1]


async def test_a_bad_cache_dir_fails_init_naming_the_setting_and_the_path(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    in_file = write_config(
        tmp_path / "in-file.yaml", tiny_config("thinker", a_file / "cache", runtime={})
    )
    failed = await failed_init(in_file)
    assert failed.reason == (
        f"cache directory {a_file / 'cache'} (cache_dir in the stage file): cannot create "
        "it: a part of the path is a file, not a directory"
    )
    from_env = tiny_config("thinker", tmp_path, runtime={})
    del from_env["cache_dir"]
    failed = await failed_init(
        write_config(tmp_path / "from-env.yaml", from_env), {"OMNI_CACHE_DIR": "/proc/omni-cache"}
    )
    assert failed.reason == (
        "cache directory /proc/omni-cache (OMNI_CACHE_DIR, as the stage file sets no "
        "cache_dir): cannot create it: a part of the path does not exist and cannot be made "
        "there"
    )
    assert "Errno" not in failed.reason
