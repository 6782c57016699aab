"""A real mesh behind a real gateway, as `omni up --http` runs it: a SmolLM2
stage process, an orchestrator over it (in the test's process, so a test can
see what the router holds) and `omni gateway` as its own process."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli.processes import GatewayProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.security import SecuritySettings, client_dialing
from services.testing.configs import stage_config
from tests.orchestrator.conftest import Stages

MODEL = "omni-test"


@dataclass
class Mesh:
    server: OrchestratorServer
    client: AsyncClient  # the gRPC client the gateway's answers are compared with
    gateway: GatewayProcess

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.address}/v1"

    @property
    def root(self) -> str:
        return f"http://{self.gateway.address}"


@asynccontextmanager
async def mesh_over(
    stages: Stages,
    folder: Path,
    *,
    edges: list[dict[str, Any]] | None = None,
    outputs: list[str] | None = None,
    security: SecuritySettings | None = None,
    token: str | None = None,
    gateway_args: dict[str, Any] | None = None,
) -> AsyncIterator[Mesh]:
    """An orchestrator over ``stages`` (pipeline ``omni-test``) and a gateway process."""
    config = parse_pipeline(
        {
            "name": MODEL,
            "stages": [{"name": n, "address": a} for n, a in stages.addresses.items()],
            "edges": edges or [],
            **({"outputs": outputs} if outputs else {}),
        },
        "gateway-test.yaml",
    )
    server = OrchestratorServer(config, security=security)
    port = await server.start("127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    log = (folder / "gateway.log").open("ab")
    gateway = GatewayProcess(address, log=log, **(gateway_args or {}))
    try:
        async with AsyncClient(address, client_dialing(token=token)) as client:
            await client.wait_ready(timeout_s=120)
            await gateway.start()
            yield Mesh(server, client, gateway)
    finally:
        await gateway.stop(5)
        log.close()
        await server.stop(1.0)


@pytest.fixture(scope="module")
async def smollm2(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Stages]:
    """One real SmolLM2-135M stage, up to four requests batched."""
    stages = Stages(tmp_path_factory.mktemp("smollm2"))
    runtime = {"torch_threads": 1, "max_batch_size": 4, "max_queue_size": 16}
    segmenting = {"max_segment_tokens": 2, "min_flush_interval_ms": 0}
    try:
        config = stage_config("thinker", omni_cache_dir, runtime=runtime, segmenting=segmenting)
        await stages.start({"thinker": config})
        yield stages
    finally:
        await stages.stop()


@pytest.fixture(scope="module")
async def mesh(smollm2: Stages, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    async with mesh_over(smollm2, tmp_path_factory.mktemp("gateway")) as running:
        yield running


def tokens_file(folder: Path) -> tuple[Path, str]:
    """A tokens file naming one client; returns it and that client's token."""
    token = secrets.token_hex(20)
    path = folder / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [{"name": "alice", "token": token}]}))
    return path, token
