"""The gateway's settings, validated once (flags and OMNI_* env, in __main__)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.mesh.security import Dialing, client_dialing

DEFAULT_MAX_BODY_BYTES = 8 << 20  # chat messages as JSON; a larger body is refused (413)


class RealtimeLimits(BaseModel):
    """What one gateway lets /v1/realtime sessions hold. Each limit, reached, is
    answered with an ``error`` event (and a close code where the session ends):
    docs/api.md lists them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_sessions: int = Field(100, ge=1)  # WebSockets open at once
    idle_s: float = Field(300.0, gt=0)  # no client event and no response for this long
    # Input audio not yet committed; OpenAI takes 15 MiB in one append.
    max_audio_buffer_bytes: int = Field(15 << 20, gt=0)
    # One client event (a WebSocket message): base64 of the largest append, and some.
    max_event_bytes: int = Field(21 << 20, gt=0)
    # Server events a client has not read yet: past it the client is too slow and
    # the session ends (1008), so a stalled reader costs the gateway this at most.
    max_unread_bytes: int = Field(8 << 20, gt=0)
    # The conversation a response sends the mesh: oldest items dropped first.
    max_items: int = Field(64, ge=1)
    max_history_tokens: int = Field(8192, ge=1)


class GatewayConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    orchestrator: str = Field(min_length=1)  # host:port, several IP:PORT, or any gRPC target
    cacert: Path | None = None  # speak TLS to the orchestrator, verified by this CA
    tls: bool = False  # speak TLS, verified by the system roots
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)
    realtime: RealtimeLimits = RealtimeLimits()
    # OpenAI voice names (and others) -> a voice of the speech stage; "" is the
    # stage's default voice (voices.py).
    voice_aliases: dict[str, str] | None = None

    @property
    def dialing(self) -> Dialing:
        """TLS like every client of the orchestrator; no token of its own: each
        call carries its caller's bearer token."""
        return client_dialing(ca=self.cacert, tls=self.tls)
