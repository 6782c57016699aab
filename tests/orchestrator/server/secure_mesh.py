"""A mesh with its own CA, mesh token and callers' tokens (alice, bob, root: the
admin), for the security tests: ``Mesh`` holds the files, ``serve`` starts an
orchestrator over one of its stages."""

from __future__ import annotations

import secrets
from pathlib import Path

import yaml

from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.security import SecuritySettings, client_dialing
from services.mesh.security.certs import MeshCA
from tests.orchestrator.conftest import Stages


class Mesh:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = MeshCA(folder / "pki")
        self.orchestrator_cert = self.ca.issue("orchestrator")
        self.mesh_token = folder / "mesh-token"
        self.mesh_token.write_text(secrets.token_hex(24) + "\n")
        self.tokens = {name: secrets.token_hex(20) for name in ("alice", "bob", "root")}
        self.tokens_file = folder / "tokens.yaml"
        entries = [{"name": n, "token": t, "admin": n == "root"} for n, t in self.tokens.items()]
        self.tokens_file.write_text(yaml.safe_dump({"tokens": entries}))
        self.stages = Stages(folder)

    def settings(self, **extra: object) -> SecuritySettings:
        cert = self.orchestrator_cert
        return SecuritySettings(
            tls_cert=cert.cert,
            tls_key=cert.key,
            tls_ca=cert.ca,
            mesh_token_file=self.mesh_token,
            tokens_file=self.tokens_file,
            **extra,
        )

    def client(self, address: str, who: str | None) -> AsyncClient:
        token = self.tokens[who] if who else None
        return AsyncClient(address, client_dialing(token=token, ca=self.ca.ca))


def pipeline(mesh: Mesh, stage: str):
    address = mesh.stages.addresses[stage].replace("127.0.0.1", "localhost")
    return parse_pipeline(
        {"name": "secure", "stages": [{"name": stage, "address": address}]}, "secure.yaml"
    )


async def serve(mesh: Mesh, stage: str, **extra: object) -> tuple[OrchestratorServer, str]:
    """An orchestrator over one of the stages (the talker: mTLS; the thinker: token)."""
    server = OrchestratorServer(pipeline(mesh, stage), security=mesh.settings(**extra))
    port = await server.start("127.0.0.1", 0)
    async with mesh.client(f"localhost:{port}", "root") as client:
        await client.wait_ready(timeout_s=60)
    return server, f"localhost:{port}"
