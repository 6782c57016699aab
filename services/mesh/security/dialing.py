"""TLS credentials from PEM files, and how a client of ours reaches a server
(``Dialing``: credentials and the bearer token sent with every call). Everything
is off unless configured, so a mesh on 127.0.0.1 works with none of it.

- TLS: ``tls_cert``/``tls_key`` make a server speak TLS. A server with
  ``tls_ca`` also *requires* a client certificate signed by that CA (mTLS: gRPC
  Python has no "verify if presented" mode, so every caller, probes included,
  then presents one). Clients verify servers against ``tls_ca`` and present
  ``client_cert``/``client_key`` (default: ``tls_cert``/``tls_key``).
- Tokens: a stage accepts the mesh token (``mesh_token_file``); the orchestrator
  accepts client tokens from ``tokens_file`` and sends the mesh token to its stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.mesh.security.settings import SecuritySettings
from services.mesh.security.tokens import read_file, read_secret, token_metadata


def server_credentials(
    settings: SecuritySettings, *, require_client_cert: bool
) -> grpc.ServerCredentials | None:
    """TLS for a server; None: plaintext. With ``require_client_cert`` (a stage
    whose settings name a ``tls_ca``) every caller must present a certificate
    signed by that CA (mTLS)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    pair = (read_file(settings.tls_key, "TLS key"), read_file(settings.tls_cert, "TLS certificate"))
    ca = None
    if require_client_cert and settings.tls_ca is not None:
        ca = read_file(settings.tls_ca, "TLS CA")
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(settings: SecuritySettings) -> grpc.ChannelCredentials | None:
    """TLS for a client: verify the server against ``tls_ca`` (else the system
    roots), present the client certificate when there is one; None: plaintext."""
    if settings.tls_ca is None and settings.client_cert is None and settings.tls_cert is None:
        return None
    cert, key = settings.client_cert or settings.tls_cert, settings.client_key or settings.tls_key
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(settings.tls_ca, "TLS CA") if settings.tls_ca else None,
        private_key=read_file(key, "TLS key") if key else None,
        certificate_chain=read_file(cert, "TLS certificate") if cert else None,
    )


@dataclass(frozen=True)
class Dialing:
    """How a client of ours reaches a server: credentials (None: plaintext) and
    the bearer token sent with every call."""

    credentials: grpc.ChannelCredentials | None = None
    token: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return token_metadata(self.token)

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.credentials, options=options)

    def sync_channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self.credentials, options=options)


PLAINTEXT = Dialing()


def client_dialing(
    *,
    token: str | None = None,
    ca: Path | None = None,
    cert: Path | None = None,
    key: Path | None = None,
    tls: bool = False,
) -> Dialing:
    """How a client reaches the orchestrator: TLS when ``tls`` or any PEM file is
    given (``ca`` verifies the server, else the system roots), and a bearer token."""
    if not (tls or ca or cert):
        return Dialing(None, token or None)
    settings = SecuritySettings(tls_ca=ca, client_cert=cert, client_key=key)
    return Dialing(channel_credentials(settings) or grpc.ssl_channel_credentials(), token or None)


def mesh_dialing(settings: SecuritySettings) -> Dialing:
    """How the orchestrator (or a tool of the mesh) reaches the stages."""
    token = read_secret(settings.mesh_token_file) if settings.mesh_token_file else None
    return Dialing(channel_credentials(settings), token)
