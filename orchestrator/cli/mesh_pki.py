"""Trust for ``omni up``, turned on by one switch: a tokens file (``OMNI_TOKENS_FILE``
or the pipeline's ``security.tokens_file``) or ``--tls``.

Either one turns on mesh auth between the orchestrator and its stages: stages
then serve Generate, Abort, ReleaseTensors and Describe to the mesh alone, and
the orchestrator sends the mesh token (the one given, else a new one). The
front door takes the clients' tokens (the file given) and ``omni up``'s own
admin token (for ``--prompt``). ``--tls`` adds a throwaway CA: each stage gets
its own certificate and requires the orchestrator's (mTLS), and the front door
speaks TLS.

Everything made here lives in ``RUN_DIR/pki`` (0700, files 0600), is handed to
the stages by OMNI_* environment variables exactly as a Kubernetes secret
mounted as files would be, and is removed when ``omni up`` stops (``remove``).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from services.mesh import environment
from services.mesh.security import SecuritySettings
from services.mesh.security.tokens import tokens_file_with

UP_TOKEN_NAME = "omni-up"  # omni up's own admin token in the front door's tokens


@dataclass(frozen=True)
class MeshTrust:
    folder: Path  # RUN_DIR/pki
    orchestrator: SecuritySettings  # its own settings: front door and dialing
    stage_env: dict[str, dict[str, str]]  # OMNI_* variables, by stage name
    admin_token: str
    admin_token_file: Path
    ca: Path | None  # --tls: the CA that signed every certificate

    def remove(self) -> None:
        """Tokens and keys go with the run: nothing is left for a later reader."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _secret(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def mesh_trust(
    run_dir: Path, stages: Iterable[str], host: str, settings: SecuritySettings, *, tls: bool
) -> MeshTrust | None:
    """What ``omni up`` runs with (``settings``: the pipeline's, then OMNI_* env);
    None when neither a tokens file nor ``tls`` asks for any (auth off)."""
    if settings.tokens_file is None and not tls:
        return None
    folder = run_dir / "pki"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    mesh_token = settings.mesh_token_file or _secret(
        folder / "mesh.token", secrets.token_urlsafe(32) + "\n"
    )
    admin_token = secrets.token_urlsafe(32)
    admin_file = _secret(folder / "admin.token", admin_token + "\n")
    tokens = _secret(
        folder / "tokens.yaml",
        tokens_file_with(settings.tokens_file, UP_TOKEN_NAME, admin_token, admin=True),
    )
    stage_env = {name: {environment.MESH_TOKEN_FILE.name: str(mesh_token)} for name in stages}
    own: dict[str, Path] = {}
    ca_file = None
    if tls:
        from services.mesh.security.certs import MeshCA

        ca = MeshCA(folder)
        ca_file = ca.ca
        hosts = (host,) if host not in ("127.0.0.1", "localhost", "0.0.0.0") else ()
        mine = ca.issue("orchestrator", hosts)
        own = {"tls_cert": mine.cert, "tls_key": mine.key, "tls_ca": ca.ca}
        for name, env in stage_env.items():
            cert = ca.issue(f"stage-{name}", hosts)
            env[environment.TLS_CERT.name] = str(cert.cert)
            env[environment.TLS_KEY.name] = str(cert.key)
            env[environment.TLS_CA.name] = str(ca.ca)
    orchestrator = settings.overridden(
        {**own, "mesh_token_file": mesh_token, "tokens_file": tokens}, "omni up"
    )
    return MeshTrust(folder, orchestrator, stage_env, admin_token, admin_file, ca_file)
