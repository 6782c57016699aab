"""Who may call what: TLS credentials from PEM files, bearer tokens, and the
server interceptor that checks them. Torch-free; both servers and every client
of ours use it. Everything is off unless configured, so a mesh on 127.0.0.1
works with none of it.

Settings come from a ``security:`` section (stage file, pipeline file), then
``OMNI_*`` environment variables (a Kubernetes secret mounted as files, with
the paths in env), then command-line flags; each layer overrides the one before.

- TLS: ``tls_cert``/``tls_key`` make a server speak TLS. A server with
  ``tls_ca`` also *requires* a client certificate signed by that CA (mTLS: gRPC
  Python has no "verify if presented" mode, so every caller, probes included,
  then presents one). Clients verify servers against ``tls_ca`` and present
  ``client_cert``/``client_key`` (default: ``tls_cert``/``tls_key``).
- Tokens: ``authorization: Bearer <token>`` metadata. A stage accepts the mesh
  token (``mesh_token_file``); the orchestrator accepts client tokens from
  ``tokens_file`` (YAML: ``tokens: [{name, token, admin}]``) and sends the mesh
  token to its stages.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.mesh import config_files
from services.mesh.config_files import ConfigError

ENV = {
    "tls_cert": "OMNI_TLS_CERT",
    "tls_key": "OMNI_TLS_KEY",
    "tls_ca": "OMNI_TLS_CA",
    "client_cert": "OMNI_TLS_CLIENT_CERT",
    "client_key": "OMNI_TLS_CLIENT_KEY",
    "mesh_token_file": "OMNI_MESH_TOKEN_FILE",
    "tokens_file": "OMNI_TOKENS_FILE",
    "max_pause_s": "OMNI_MAX_PAUSE_S",
}
MIN_TOKEN_CHARS = 16


class SecuritySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

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
        environ = os.environ if environ is None else environ
        values = {key: environ.get(var) for key, var in ENV.items()}
        return self.overridden(values, "environment (OMNI_TLS_*, OMNI_*_FILE)")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name, the mesh, or the anonymous caller (auth off)."""

    name: str
    admin: bool = False
    mesh: bool = False


# With authentication off every caller is this one principal, allowed everything.
ANONYMOUS = Principal("anonymous", admin=True, mesh=True)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror})") from None


def read_secret(path: Path) -> str:
    """A token kept in a file (a mounted secret): its text, whitespace stripped."""
    try:
        token = _read(path, "token file").decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: expected a UTF-8 token") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{path}: expected a token of at least {MIN_TOKEN_CHARS} characters")
    return token


class _TokenEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$")
    token: str = Field(min_length=MIN_TOKEN_CHARS)
    admin: bool = False


class _TokensFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens: tuple[_TokenEntry, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> _TokensFile:
        names = [t.name for t in self.tokens]
        if len(set(names)) != len(names):
            raise ValueError("tokens: expected each name once")
        if len({t.token for t in self.tokens}) != len(self.tokens):
            raise ValueError("tokens: expected each token once")
        return self


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Tokens:
    """Bearer tokens and whom each one names; looked up by digest, compared in constant time."""

    def __init__(self, principals: Mapping[str, Principal]) -> None:
        self._by_digest = {_digest(t): p for t, p in principals.items()}

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    @classmethod
    def load(cls, path: Path) -> Tokens:
        parsed = config_files.load(_TokensFile, path)
        return cls({t.token: Principal(t.name, admin=t.admin) for t in parsed.tokens})

    def principal(self, token: str) -> Principal | None:
        digest = _digest(token)
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        return None


def bearer(metadata: Collection[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Authenticator:
    """Turns a call's metadata and TLS peer into a Principal (None: not authenticated).

    ``peer_cert_is_mesh``: a verified client certificate (mTLS) makes the caller
    the mesh. With no tokens and no mTLS, everyone is ``ANONYMOUS``.
    """

    def __init__(self, tokens: Tokens, *, peer_cert_is_mesh: bool = False) -> None:
        self.tokens = tokens
        self.peer_cert_is_mesh = peer_cert_is_mesh

    @property
    def enabled(self) -> bool:
        return bool(self.tokens) or self.peer_cert_is_mesh

    def principal(self, context: grpc.aio.ServicerContext) -> Principal | None:
        if not self.enabled:
            return ANONYMOUS
        if self.peer_cert_is_mesh and context.peer_identities():
            return Principal("mesh", mesh=True)
        token = bearer(context.invocation_metadata())
        return self.tokens.principal(token) if token else None


Rule = Callable[[Principal], bool]
Check = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


def anyone(_principal: Principal) -> bool:
    return True


def admin_only(principal: Principal) -> bool:
    return principal.admin


def mesh_only(principal: Principal) -> bool:
    return principal.mesh


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call against the rule for its method (full name, e.g.
    ``/omni.v1.Stage/Generate``); methods without a rule are open (health,
    reflection). Refuses with UNAUTHENTICATED (no or unknown credentials) or
    PERMISSION_DENIED (a known caller without the right)."""

    def __init__(self, authenticator: Authenticator, rules: Mapping[str, Rule]) -> None:
        self._auth = authenticator
        self._rules = dict(rules)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        rule = self._rules.get(handler_call_details.method)  # type: ignore[attr-defined]
        if handler is None or rule is None or not self._auth.enabled:
            return handler
        return _guarded(handler, self._check(rule, handler_call_details.method))  # type: ignore[attr-defined]

    def _check(
        self, rule: Rule, method: str
    ) -> Callable[[grpc.aio.ServicerContext], Awaitable[None]]:
        async def check(context: grpc.aio.ServicerContext) -> None:
            principal = self._auth.principal(context)
            if principal is None:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{method}: expected 'authorization: Bearer <token>' with a known token",
                )
            elif not rule(principal):
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: {principal.name!r} may not call this",
                )

        return check


def _guarded(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """``handler`` with ``check`` run before its behaviour, for all four call kinds."""
    if handler.response_streaming:
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            async for reply in inner(request, context):
                yield reply

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return make(streaming, handler.request_deserializer, handler.response_serializer)
    inner = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        return await inner(request, context)

    make = (
        grpc.stream_unary_rpc_method_handler
        if handler.request_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(unary, handler.request_deserializer, handler.response_serializer)


def server_credentials(
    settings: SecuritySettings, *, require_client_cert: bool
) -> grpc.ServerCredentials | None:
    """TLS for a server; None: plaintext. With ``require_client_cert`` (a stage
    whose settings name a ``tls_ca``) every caller must present a certificate
    signed by that CA (mTLS)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    pair = (_read(settings.tls_key, "TLS key"), _read(settings.tls_cert, "TLS certificate"))
    ca = None
    if require_client_cert and settings.tls_ca is not None:
        ca = _read(settings.tls_ca, "TLS CA")
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
        root_certificates=_read(settings.tls_ca, "TLS CA") if settings.tls_ca else None,
        private_key=_read(key, "TLS key") if key else None,
        certificate_chain=_read(cert, "TLS certificate") if cert else None,
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


def stage_authenticator(settings: SecuritySettings) -> Authenticator:
    """A stage's: the mesh token, and (mTLS) any client certificate of the mesh CA."""
    principals = {}
    if settings.mesh_token_file is not None:
        principals[read_secret(settings.mesh_token_file)] = Principal("mesh", mesh=True)
    mtls = settings.tls and settings.tls_ca is not None
    return Authenticator(Tokens(principals), peer_cert_is_mesh=mtls)


def orchestrator_authenticator(settings: SecuritySettings) -> Authenticator:
    """The orchestrator's front door: client tokens from ``tokens_file``."""
    tokens = Tokens.load(settings.tokens_file) if settings.tokens_file else Tokens({})
    return Authenticator(tokens)
