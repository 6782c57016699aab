"""The gateway's settings, validated once (flags and OMNI_* env, in __main__)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.mesh.security import Dialing, client_dialing

DEFAULT_MAX_BODY_BYTES = 8 << 20  # chat messages as JSON; a larger body is refused (413)


class GatewayConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    orchestrator: str = Field(min_length=1)  # host:port, or any gRPC target
    cacert: Path | None = None  # speak TLS to the orchestrator, verified by this CA
    tls: bool = False  # speak TLS, verified by the system roots
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)

    @property
    def dialing(self) -> Dialing:
        """TLS like every client of the orchestrator; no token of its own: each
        call carries its caller's bearer token."""
        return client_dialing(ca=self.cacert, tls=self.tls)
