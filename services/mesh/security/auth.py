"""Who may call what: the server interceptor both servers install, which finds
the caller's ``Principal`` (a bearer token, or a mesh client certificate under
mTLS) and checks it against each method's rule (anyone, admin only, mesh only)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from services.mesh.security.settings import SecuritySettings
from services.mesh.security.tokens import ANONYMOUS, Principal, Tokens, bearer, read_secret


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

    @property
    def authenticator(self) -> Authenticator:
        return self._auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        rule = self._rules.get(handler_call_details.method)
        if handler is None or rule is None or not self._auth.enabled:
            return handler
        return _guarded(handler, self._check(rule, handler_call_details.method))

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
