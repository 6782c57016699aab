"""``omni up --tls``: a throwaway mesh CA and everything that hangs off it.

Each stage gets its own certificate and requires the orchestrator's (mTLS), and
also knows the mesh token; the orchestrator speaks TLS at its front door and
takes one admin bearer token. Everything lives in ``RUN_DIR/pki`` (0700, files
0600) and is handed to the stages by OMNI_* environment variables, exactly as a
Kubernetes secret mounted as files would be.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.mesh import environment
from services.mesh.security import SecuritySettings
from services.mesh.security.certs import MeshCA


@dataclass(frozen=True)
class MeshPki:
    ca: Path
    orchestrator: SecuritySettings  # its own settings: front door and dialing
    stage_env: dict[str, dict[str, str]]  # OMNI_* variables, by stage name
    admin_token_file: Path


def _secret(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def make_mesh_pki(run_dir: Path, stages: Iterable[str], host: str) -> MeshPki:
    folder = run_dir / "pki"
    ca = MeshCA(folder)
    os.chmod(folder, 0o700)
    mesh_token = _secret(folder / "mesh.token", secrets.token_urlsafe(32) + "\n")
    admin_token = secrets.token_urlsafe(32)
    admin_file = _secret(folder / "admin.token", admin_token + "\n")
    tokens = _secret(
        folder / "tokens.yaml",
        yaml.safe_dump({"tokens": [{"name": "admin", "token": admin_token, "admin": True}]}),
    )
    hosts = (host,) if host not in ("127.0.0.1", "localhost", "0.0.0.0") else ()
    own = ca.issue("orchestrator", hosts)
    stage_env = {}
    for name in stages:
        cert = ca.issue(f"stage-{name}", hosts)
        stage_env[name] = {
            environment.TLS_CERT.name: str(cert.cert),
            environment.TLS_KEY.name: str(cert.key),
            environment.TLS_CA.name: str(ca.ca),
            environment.MESH_TOKEN_FILE.name: str(mesh_token),
        }
    settings = SecuritySettings(
        tls_cert=own.cert,
        tls_key=own.key,
        tls_ca=ca.ca,
        mesh_token_file=mesh_token,
        tokens_file=tokens,
    )
    return MeshPki(ca.ca, settings, stage_env, admin_file)
