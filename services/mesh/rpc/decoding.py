"""A frame that does not decode as the method's request message ends the RPC
with INVALID_ARGUMENT naming the message, on every method of a server: the one
way of both servers, hand-written deserializers included (the stage's Generate
reads chunks by hand, ``services.stage.serving.frames``), which just raise.

Left to itself, gRPC reports a request deserializer's exception as UNKNOWN with
the Python exception's class in the message. ``DecodingInterceptor`` wraps each
handler: its deserializer returns an ``Undecodable`` marker instead of raising,
and its behaviour aborts the call on one (for streaming requests, when the
marker is reached, after the frames before it were handled: the behaviour gets
``UndecodableFrame``, an ``InvalidArgument``, from its request iterator and the
call ends with it when it comes out of the behaviour).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.mesh.errors import InvalidArgument, abort_rpc


class Undecodable:
    """What the deserializer gives for a frame that is not the request message."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(frame: bytes) -> Any:
        try:
            return deserializer(frame)
        except Exception as exc:  # DecodeError, bad UTF-8 in a string field, …
            return Undecodable(str(exc) or "malformed protobuf")

    return decode


class UndecodableFrame(InvalidArgument):
    """A frame that is not a valid ``message``. Raised to a streaming behaviour where
    its requests reach one; the RPC ends with it when it comes out of the behaviour
    (the interceptor's, or the behaviour's own ``abort_rpc``). Aborting where the
    frame is read instead would abort from whatever task reads the requests, racing
    the handler's own writes (a call aborted so while it wrote a reply never ended)."""

    def __init__(self, message: str, bad: Undecodable) -> None:
        super().__init__(f"request: the frame is not a valid {message} ({bad.reason})")


class DecodingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, request_names: dict[str, str]) -> None:
        # method path -> the request message's name, for the error message
        self._names = request_names

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        return _strict(handler, self._names.get(method, "request message"))


def _strict(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    decode = lenient(handler.request_deserializer)
    serialize = handler.response_serializer

    async def frames(requests: AsyncIterator[Any]) -> Any:
        async for request in requests:
            if isinstance(request, Undecodable):
                raise UndecodableFrame(message, request)
            yield request

    if handler.request_streaming and handler.response_streaming:
        inner_ss = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: Any) -> Any:
            try:
                async for reply in replies(inner_ss(frames(requests), context)):
                    yield reply
            except UndecodableFrame as exc:
                await abort_rpc(context, exc)

        return grpc.stream_stream_rpc_method_handler(stream_stream, decode, serialize)
    if handler.request_streaming:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
            try:
                return await inner_su(frames(requests), context)
            except UndecodableFrame as exc:
                await abort_rpc(context, exc)

        return grpc.stream_unary_rpc_method_handler(stream_unary, decode, serialize)
    if handler.response_streaming:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await abort_rpc(context, UndecodableFrame(message, request))
            async for reply in replies(inner_us(request, context)):
                yield reply

        return grpc.unary_stream_rpc_method_handler(unary_stream, decode, serialize)
    inner_uu = handler.unary_unary

    async def unary_unary(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await abort_rpc(context, UndecodableFrame(message, request))
        return await inner_uu(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, decode, serialize)


async def replies(result: Any) -> AsyncIterator[Any]:
    """A streaming behaviour's replies: it is an async generator, or a coroutine that
    writes its replies itself with ``context.write`` (grpc's aio health Watch)."""
    if inspect.isawaitable(result):
        await result
        return
    async for reply in result:
        yield reply


def request_names(*services: Any) -> dict[str, str]:
    """Method path -> request message name, from service descriptors."""
    return {
        f"/{service.full_name}/{method.name}": method.input_type.full_name
        for service in services
        for method in service.methods
    }
