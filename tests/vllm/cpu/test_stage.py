"""The vllm engine as a stage process on vLLM's CPU build: its memory plan is
vLLM's own KV cache; when vLLM's engine process dies the stage turns FAILED and
exits 3; and a pipeline whose thinker is the vllm engine answers through the
orchestrator, the stage run by the Python the pipeline names."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import psutil
import yaml

from orchestrator.cli.launcher import Launcher
from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import load_pipeline
from services.engines.vllm import cpu
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.__main__ import EXIT_ENGINE_DEAD
from services.testing.configs import write_config
from tests.helpers.stage import chat, collect
from tests.vllm.cpu.conftest import QUESTION

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "stages" / "vllm-cpu.yaml"


def vllm_stage(cache_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return {**config, "cache_dir": str(cache_dir)}


def engine_core(stage_pid: int) -> psutil.Process:
    """vLLM's engine-core process under the stage (it names itself VLLM::EngineCore)."""
    for child in psutil.Process(stage_pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no EngineCore process under pid {stage_pid}")


async def test_a_dead_vllm_engine_fails_the_stage_process(
    cpu_vllm: None, tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    log = (tmp_path / "stage.log").open("wb")
    config = write_config(tmp_path / "thinker.yaml", vllm_stage(omni_cache_dir))
    stage = StageProcess(config, log=log, env={"PYTHONPATH": str(ROOT)})
    try:
        address = await stage.start(timeout_s=120)
        async with StageClient(address) as client:
            events = await client.wait_ready(timeout_s=300)
            described = await client.describe()
            held = client.open_stream()
            await held.write(chat("held", "Count from one to a thousand.", max_tokens=1500))
            first = await held.read()
            assert first.WhichOneof("kind") == "segment", first
            engine_core(stage.pid).kill()
            await held.done_writing()
            victim = (await collect(held))["held"]
        code = await asyncio.wait_for(stage.wait(), 60)
    finally:
        await stage.stop(5)
        log.close()
    planned = next(e for e in events if e.phase == stage_pb2.MEMORY_PLANNED).memory
    # vLLM's own cache (1 GiB by default) in its own blocks, not a share of host RAM.
    assert planned.page_size == 128 and planned.free_before_bytes == 0
    assert planned.cache_budget_bytes == planned.cache_pages * planned.bytes_per_page
    assert 0.9 * (1 << 30) < planned.cache_budget_bytes <= 1.1 * (1 << 30)
    assert victim.error is not None and victim.error.code_name == "UNAVAILABLE"
    # The stage may be gone before a client could ask it: its log has the event.
    assert "FAILED the engine died" in (tmp_path / "stage.log").read_text()
    assert code == EXIT_ENGINE_DEAD
    # Describe says which of vLLM's CPU kernel builds it runs (named, never imported).
    assert described.compute.startswith("vLLM ") and f"kernels {cpu.kernels()}" in described.compute


async def test_a_vllm_thinker_answers_through_the_orchestrator(
    cpu_vllm: None, plain: dict[str, Any], tmp_path: Path, omni_cache_dir: Path
) -> None:
    stage_file = write_config(tmp_path / "thinker.yaml", vllm_stage(omni_cache_dir))
    pipeline = tmp_path / "vllm.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "name": "vllm",
                # The stage's own Python, named (this venv's here; any venv with vLLM).
                "stages": [
                    {"name": "thinker", "launch": str(stage_file), "python": sys.executable}
                ],
            }
        )
    )
    config = load_pipeline(pipeline)
    assert config.stages[0].python == Path(sys.executable)
    launcher = Launcher(config, run_dir=tmp_path / "run", mesh_id="vllmup", port=0)
    try:
        await launcher.start()
        async with AsyncClient(launcher.address) as client:
            await client.wait_ready(timeout_s=300)
            result = await client.generate(QUESTION, params={"max_tokens": 12}).collect()
    finally:
        await launcher.stop()
    assert result.ok, result.done
    # What plain vLLM says to the same chat prompt on this machine, token for token.
    assert result.stages["thinker"].token_ids == plain["token_ids"][-1][:12]
