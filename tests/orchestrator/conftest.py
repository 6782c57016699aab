"""Real stage processes shared by a test module, and orchestrators over them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import tiny_config, write_config

RENDER_DIM = 64  # the tiny Llama's hidden size: its hidden states condition the renderer
THINK_TO_RENDER = [
    {"from": "thinker", "to": "renderer", "transform": "hidden_states_to_prompt_embeds"}
]


def renderer_config(cache_dir: Path, **runtime: Any) -> dict[str, Any]:
    return {
        "name": "renderer",
        "engine": "diffusers",
        "load_format": "dummy",
        "engine_args": {"cross_attention_dim": RENDER_DIM, "num_inference_steps": 4},
        "cache_dir": str(cache_dir),
        "runtime": {"torch_threads": 1, **runtime},
    }


def segmented_thinker(cache_dir: Path, **runtime: Any) -> dict[str, Any]:
    """The tiny thinker whose hidden states leave in full segments of 4 rows of
    RENDER_DIM float32 (1 KiB), the first included, each over ``inline_max_bytes``
    1024: every one goes by the transport the stages' placement picks."""
    return tiny_config(
        "thinker",
        cache_dir,
        runtime={"torch_threads": 1, "inline_max_bytes": 1024, **runtime},
        segmenting={"first_segment_tokens": 4},
    )


class Stages:
    """Stage processes by name, started together and stopped on every path."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.env = env
        self.processes: dict[str, StageProcess] = {}
        self.addresses: dict[str, str] = {}

    async def start(self, configs: dict[str, dict[str, Any]]) -> None:
        for name, config in configs.items():
            path = write_config(self.folder / f"{name}.yaml", config)
            process = StageProcess(path, env=self.env)
            self.processes[name] = process
            self.addresses[name] = await process.start()
        for address in self.addresses.values():
            async with StageClient(address) as client:
                await client.wait_ready(timeout_s=180)

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop(5) for p in self.processes.values()))


@pytest.fixture(scope="module")
async def stages(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Stages]:
    stages = Stages(tmp_path_factory.mktemp("stages"))
    runtime = {"torch_threads": 1, "max_batch_size": 1, "max_queue_size": 16}
    try:
        await stages.start(
            {
                # Hidden states go by shared memory to a consumer on this node.
                "thinker": segmented_thinker(omni_cache_dir, **runtime),
                "talker": tiny_config("talker", omni_cache_dir, runtime=runtime),
                "renderer": renderer_config(omni_cache_dir),
            }
        )
        yield stages
    finally:
        await stages.stop()


def pipeline(stages: Stages, stage_names: list[str], edges: list[dict[str, Any]], **extra: Any):
    return parse_pipeline(
        {
            "name": "test",
            "stages": [{"name": n, "address": stages.addresses[n]} for n in stage_names],
            "edges": edges,
            **extra,
        },
        "test-pipeline.yaml",
    )


@asynccontextmanager
async def orchestrator(
    config, **options: Any
) -> AsyncIterator[tuple[OrchestratorServer, AsyncClient]]:
    server = OrchestratorServer(config, **options)
    port = await server.start("127.0.0.1", 0)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=60)
            yield server, client
    finally:
        await server.stop(1.0)
