"""A real mesh for hostile input: a tiny-model stage and an orchestrator in front
of it, both with authentication on (a mesh token at the stage, client tokens at
the orchestrator, no TLS), started once per module; and the ordinary request
that must go on completing whatever a hostile one does."""

from __future__ import annotations

import secrets
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.data.node import node_identity
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.mesh.security import Dialing, SecuritySettings, client_dialing
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config
from tests.helpers.shm_blocks import blocks_of

CONTROL_TOKENS = 24  # what the ordinary request asks for, and must get


@dataclass
class Mesh:
    folder: Path
    stage_server: StageServer
    orchestrator: OrchestratorServer
    stage_address: str
    address: str
    mesh_token: str
    tokens: dict[str, str]
    victim: tensor_pb2.Tensor  # a shared block the stage produced for request "victim"

    def stage(self, who: str | None = "mesh") -> StageClient:
        """A client of the stage: the mesh (its token) or a stranger (None)."""
        return StageClient(self.stage_address, Dialing(None, self.mesh_token if who else None))

    def client(self, who: str | None = "alice") -> AsyncClient:
        """A client of the orchestrator with a user's token (None: anonymous)."""
        return AsyncClient(self.address, client_dialing(token=self.tokens[who] if who else None))

    async def control(self, request_id: str) -> None:
        """An ordinary request through the orchestrator: it completes, every token there."""
        async with self.client("alice") as alice:
            result = await alice.generate(
                "Count to ten.",
                request_id=request_id,
                params={"max_tokens": CONTROL_TOKENS, "temperature": 0.0},
            ).collect()
        assert result.ok, result.done
        assert len(result.stages["thinker"].token_ids) == CONTROL_TOKENS
        assert result.stages["thinker"].completed.usage.completion_tokens == CONTROL_TOKENS

    async def serving(self) -> None:
        """Both servers still answer health SERVING."""
        for address in (self.address, self.stage_address):
            async with grpc.aio.insecure_channel(address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, address


def own_blocks(producer: str) -> set[str]:
    """The shared blocks of the stage's producer (its lock token ``producer``)."""
    return {name for name in blocks_of("default") if f"-{producer}-" in name}


async def _victim_block(mesh: Mesh) -> tensor_pb2.Tensor:
    """Hidden states of request "victim", handed over by shared memory to a
    consumer on this node (the test's own identity)."""
    submit = chat_submit("victim", "Hello there", max_tokens=2, return_hidden_states=True)
    submit.consumer.CopyFrom(node_identity())
    async with mesh.stage() as stage:
        outputs = [o async for o in stage.generate(submit)]
    refs = [t for o in outputs if o.WhichOneof("kind") == "segment" for t in o.segment.tensors]
    shared = [t for t in refs if t.WhichOneof("data") == "shm"]
    assert shared, f"expected hidden states by shm, got {[t.WhichOneof('data') for t in refs]}"
    return shared[0]


@pytest.fixture(scope="module")
async def mesh(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Mesh]:
    folder = tmp_path_factory.mktemp("hostile")
    mesh_token = secrets.token_hex(24)
    (folder / "mesh-token").write_text(mesh_token + "\n")
    tokens = {name: secrets.token_hex(20) for name in ("alice", "bob", "root")}
    entries = [{"name": n, "token": t, "admin": n == "root"} for n, t in tokens.items()]
    (folder / "tokens.yaml").write_text(yaml.safe_dump({"tokens": entries}))
    config = tiny_config(
        "thinker",
        omni_cache_dir,
        runtime={
            "torch_threads": 1,
            "max_batch_size": 4,
            "max_queue_size": 32,
            "inline_max_bytes": 0,  # hidden states go by shm to a consumer on this node
        },
        segmenting={"max_segment_tokens": 4, "min_flush_interval_ms": 0},
        security={"mesh_token_file": str(folder / "mesh-token")},
    )
    stage = StageServer(parse_stage_config(config))
    stage_port = await stage.start("127.0.0.1", 0)
    assert stage.tensors.shm is not None
    producer = stage.tensors.shm.files.token
    pipeline = parse_pipeline(
        {"name": "hostile", "stages": [{"name": "thinker", "address": f"127.0.0.1:{stage_port}"}]},
        "hostile.yaml",
    )
    security = SecuritySettings(
        mesh_token_file=folder / "mesh-token", tokens_file=folder / "tokens.yaml", max_pause_s=1.0
    )
    orchestrator = OrchestratorServer(pipeline, security=security)
    try:
        port = await orchestrator.start("127.0.0.1", 0)
        await orchestrator.wait_ready(180)
        mesh = Mesh(
            folder,
            stage,
            orchestrator,
            f"127.0.0.1:{stage_port}",
            f"127.0.0.1:{port}",
            mesh_token,
            tokens,
            tensor_pb2.Tensor(),
        )
        mesh.victim = await _victim_block(mesh)
        yield mesh
        assert stage.runtime.in_flight == 0
    finally:
        await orchestrator.stop(1.0)
        await stage.stop(1.0)
    # Nothing left behind: every block the stage made is gone with it, and both ports.
    assert not own_blocks(producer)
    for port in (stage.port, orchestrator.port):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listens"
