"""How a server reads its callers' messages, on every method of both servers.

- **Never before the caller is checked.** gRPC reads a unary request whole (up to
  the server's receive limit) before its handler runs, so a check in the handler
  comes after the memory is spent. Every handler is therefore served as one that
  reads its requests itself: the auth interceptor, which runs first, refuses a
  stranger on its metadata alone and nothing of its message is read (HTTP/2 flow
  control holds the rest at the sender).
- **The first message in time.** A unary call whose message has not arrived
  within ``first_message_timeout_s`` ends DEADLINE_EXCEEDED, and so does a
  stranger's stream (reflection, say): a call that opens and says nothing would
  otherwise hold its call and task for ever. A known caller's stream may wait:
  the orchestrator opens a consuming stage's stream while the producer works.
- **A unary request paid for before it is read.** gRPC buffers up to the receive
  limit whatever the method, so that much is reserved from an ``InputBudget``
  first (RESOURCE_EXHAUSTED, nothing read, when the budget is spent), then only
  the message's own size until the call ends. A known caller (its token or mesh
  certificate; everyone, with auth off) draws on the budget the server is given
  (the orchestrator's: its unary Generate counts with its clients' chunks; none
  for a stage). A stranger, who reaches only the open methods (health,
  reflection), draws on a budget of its own, ``OPEN_READS`` messages of the
  largest size: strangers together never hold more, and never spend the budget
  of the callers who have credentials.

A stream's later messages are not reserved before they are read (one may be in
flight per stream); whoever holds them once read charges them (chunks, windows).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.mesh.data.byte_budget import InputBudget, StreamAccount
from services.mesh.errors import DeadlineExceeded, InvalidArgument, OmniError, abort_rpc
from services.mesh.rpc.decoding import replies
from services.mesh.security import Authenticator

# Open-method messages of the largest size read at once (health, reflection).
OPEN_READS = 8


class _End:
    """No message came: the caller half-closed first."""


END = _End()


class ReadsInterceptor(grpc.aio.ServerInterceptor):
    """Serves every method as one that reads its own requests (see the module).

    ``authenticator``: tells known callers, who draw on ``budget`` (None: they
    reserve nothing), from strangers, who draw on ``open_budget``."""

    def __init__(
        self,
        authenticator: Authenticator,
        *,
        receive_bytes: int,
        first_message_timeout_s: float,
        budget: InputBudget | None = None,
    ) -> None:
        self._auth = authenticator
        self._receive_bytes = receive_bytes
        self._timeout_s = first_message_timeout_s
        self._budget = budget
        self.open_budget = InputBudget(OPEN_READS * receive_bytes, "the open methods' reads")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.request_streaming:
            return _streaming(handler, self.stream_head)
        return _unary(handler, self.read_one)

    async def stream_head(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """A stream's first message (``END`` if none), within the first-message
        timeout for a stranger; ``None`` for a known caller (nothing is awaited)."""
        if self._auth.principal(context) is not None:
            return None
        return await self.first(requests)

    async def first(self, requests: AsyncIterator[Any]) -> Any:
        """The first message (``END`` if none), within the first-message timeout."""
        try:
            return await asyncio.wait_for(anext(aiter(requests)), self._timeout_s)
        except StopAsyncIteration:
            return END
        except TimeoutError:
            raise DeadlineExceeded(
                f"request: no message within {self._timeout_s:g}s of the call's start "
                "(first_message_timeout_s)",
                field="request",
            ) from None

    async def read_one(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> tuple[Any, StreamAccount | None]:
        """A unary call's one message, paid for (the account: close it when the
        call ends); raises an OmniError (RESOURCE_EXHAUSTED: nothing was read)."""
        known = self._auth.principal(context) is not None
        budget = self._budget if known else self.open_budget
        reserve = self._receive_bytes
        account = None
        if budget is not None:
            account = budget.account(reserve, budget.key)
            account.reserve(reserve, "request")
        try:
            request = await self.first(requests)
            if request is END:
                raise InvalidArgument("request: expected a message, got none", field="request")
            # Read to the end of the requests: a reader left waiting keeps the
            # message it last read alive in its frame for as long as gRPC keeps
            # the call's state, which is past the call's end.
            if await self.first(requests) is not END:
                raise InvalidArgument("request: expected one message", field="request")
        except BaseException:
            if account is not None:
                account.close()
            raise
        if account is not None:
            account.release(max(reserve - request.ByteSize(), 0))
        return request, account


def _streaming(
    handler: grpc.RpcMethodHandler, head_of: Callable[[AsyncIterator[Any], Any], Awaitable[Any]]
) -> grpc.RpcMethodHandler:
    async def requests_from(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        try:
            head = await head_of(requests, context)
        except OmniError as exc:
            await abort_rpc(context, exc)
        return requests if head is None else _then(head, requests)

    if handler.response_streaming:
        inner_ss = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: Any) -> Any:
            rest = await requests_from(requests, context)
            async for reply in replies(inner_ss(rest, context)):
                yield reply

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, handler.request_deserializer, handler.response_serializer
        )
    inner_su = handler.stream_unary

    async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
        return await inner_su(await requests_from(requests, context), context)

    return grpc.stream_unary_rpc_method_handler(
        stream_unary, handler.request_deserializer, handler.response_serializer
    )


async def _then(head: Any, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if head is END:
        return
    yield head
    async for request in requests:
        yield request


Read = Callable[[AsyncIterator[Any], Any], Awaitable[tuple[Any, StreamAccount | None]]]


def _unary(handler: grpc.RpcMethodHandler, read: Read) -> grpc.RpcMethodHandler:
    async def one(requests: AsyncIterator[Any], context: Any) -> tuple[Any, StreamAccount | None]:
        try:
            return await read(requests, context)
        except OmniError as exc:
            await abort_rpc(context, exc)

    if handler.response_streaming:
        inner_us = handler.unary_stream

        async def unary_stream(requests: AsyncIterator[Any], context: Any) -> Any:
            request, account = await one(requests, context)
            try:
                async for reply in replies(inner_us(request, context)):
                    yield reply
            finally:
                if account is not None:
                    account.close()

        return grpc.stream_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    inner_uu = handler.unary_unary

    async def unary_unary(requests: AsyncIterator[Any], context: Any) -> Any:
        request, account = await one(requests, context)
        try:
            return await inner_uu(request, context)
        finally:
            if account is not None:
                account.close()

    return grpc.stream_unary_rpc_method_handler(
        unary_unary, handler.request_deserializer, handler.response_serializer
    )
