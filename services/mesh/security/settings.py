"""Security settings of one process: TLS files, token files and the pause limit,
from a ``security:`` section (stage file, pipeline file), then ``OMNI_*``
environment variables (a Kubernetes secret mounted as files, with the paths in
env), then command-line flags; each layer overrides the one before."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from services.mesh import config_files, environment
from services.mesh.config_files import Frozen
from services.mesh.environment import Variable

# The environment layer: each setting's variable (services.mesh.environment).
ENV: dict[str, Variable[Any]] = {
    "tls_cert": environment.TLS_CERT,
    "tls_key": environment.TLS_KEY,
    "tls_ca": environment.TLS_CA,
    "client_cert": environment.TLS_CLIENT_CERT,
    "client_key": environment.TLS_CLIENT_KEY,
    "mesh_token_file": environment.MESH_TOKEN_FILE,
    "tokens_file": environment.TOKENS_FILE,
    "max_pause_s": environment.MAX_PAUSE_S,
}
MIN_TOKEN_CHARS = 16


class SecuritySettings(Frozen):
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    mesh_token_file: Path | None = None
    tokens_file: Path | None = None
    # Longest a PauseGeneration holds new requests; after it they get UNAVAILABLE.
    max_pause_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _pairs(self) -> SecuritySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: expected both or neither")
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key: expected both or neither")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def overridden(self, values: Mapping[str, Any], source: str) -> SecuritySettings:
        """These settings with ``values`` (unset ones ignored) laid over them."""
        data = self.model_dump(exclude_unset=True)
        data.update({k: v for k, v in values.items() if v is not None and v != ""})
        return config_files.validate(SecuritySettings, data, source)

    def with_env(self, environ: Mapping[str, str] | None = None) -> SecuritySettings:
        values = {key: variable.get(environ) for key, variable in ENV.items()}
        return self.overridden(values, "environment (OMNI_TLS_*, OMNI_*_FILE)")
