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
  first, then only the message's own size until the call ends. A call finding
  the budget spent waits for it (a burst of small calls only queues) until its
  first-message deadline, then ends RESOURCE_EXHAUSTED with nothing read. A
  known caller (its token or mesh certificate) draws on the budget the server is
  given (the orchestrator's: its unary Generate counts with its clients' chunks;
  none for a stage), at most a quarter of it (``CALLER_SHARE``) at once, so one
  caller's slow sends cannot starve the others; with auth off, each client host
  is a caller. A stranger, who reaches only the open methods (health,
  reflection), draws on a budget of its own, ``OPEN_READS`` messages of the
  largest size: strangers together never hold more, and never spend the budget
  of the callers who have credentials.

A stream's later messages are not reserved before they are read (one may be in
flight per stream); whoever holds them once read charges them (chunks, windows).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.mesh.data.byte_budget import InputBudget, StreamAccount
from services.mesh.errors import (
    DeadlineExceeded,
    InvalidArgument,
    OmniError,
    ResourceExhausted,
    abort_rpc,
)
from services.mesh.rpc.decoding import replies
from services.mesh.security import Authenticator

# Open-method messages of the largest size read at once (health, reflection).
OPEN_READS = 8
# A known caller reserves at most this fraction of the server's budget at once.
CALLER_SHARE = 4
BUDGET_POLL_S = 0.05  # a read waiting for budget looks again (other holders free it too)
Release = Callable[[], None]  # gives back what a call holds


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
        self._strangers = self.open_budget.account(
            self.open_budget.limit, self.open_budget.key, "stranger"
        )
        self._callers: dict[str, StreamAccount] = {}  # known callers holding reads now
        self._freed = asyncio.Event()  # a read gave budget back

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

    async def first(self, requests: AsyncIterator[Any], deadline: float | None = None) -> Any:
        """The first message (``END`` if none), by ``deadline`` (loop time; default:
        the first-message timeout from now)."""
        loop = asyncio.get_running_loop()
        left = self._timeout_s if deadline is None else max(deadline - loop.time(), 0.0)
        try:
            # A timeout scope, not wait_for: wait_for (3.11) runs the read in a task
            # of its own, two per unary call.
            async with asyncio.timeout(left):
                return await anext(aiter(requests))
        except StopAsyncIteration:
            return END
        except TimeoutError:
            raise DeadlineExceeded(
                f"request: no message within {self._timeout_s:g}s of the call's start "
                "(first_message_timeout_s)",
                field="request",
            ) from None

    def _account(self, context: grpc.aio.ServicerContext) -> tuple[str, StreamAccount | None]:
        """Who pays for this call's reads ("" for strangers) and from what (None: nothing)."""
        principal = self._auth.principal(context)
        if principal is None:
            return "", self._strangers
        if self._budget is None:
            return "", None
        caller = principal.name if self._auth.enabled else _host(context.peer())
        account = self._callers.get(caller)
        if account is None:
            share = max(self._receive_bytes, self._budget.limit // CALLER_SHARE)
            key = f"a quarter of {self._budget.key}"
            account = self._callers[caller] = self._budget.account(share, key, "caller")
        return caller, account

    def _release(
        self, caller: str, account: StreamAccount, nbytes: int, freed: bool = True
    ) -> None:
        account.release(nbytes, freed=freed)
        if nbytes:
            self._freed.set()
        if caller and not account.held:  # a caller holding nothing is forgotten
            self._callers.pop(caller, None)

    async def _reserve(self, account: StreamAccount, nbytes: int, deadline: float) -> None:
        """Charge ``nbytes``, waiting for them until ``deadline`` (then the refusal)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                account.reserve(nbytes, "request")
                return
            except ResourceExhausted:
                left = deadline - loop.time()
                if left <= 0:
                    raise
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, BUDGET_POLL_S)):
                    await self._freed.wait()

    async def read_one(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> tuple[Any, Release | None]:
        """A unary call's one message, paid for (call the release when the call
        ends); raises an OmniError (RESOURCE_EXHAUSTED: nothing was read)."""
        caller, account = self._account(context)
        reserve = self._receive_bytes
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        if account is not None:
            await self._reserve(account, reserve, deadline)
        try:
            request = await self.first(requests, deadline)
            if request is END:
                raise InvalidArgument("request: expected a message, got none", field="request")
            # Read to the end of the requests: a reader left waiting keeps the
            # message it last read alive in its frame for as long as gRPC keeps
            # the call's state, which is past the call's end.
            if await self.first(requests) is not END:
                raise InvalidArgument("request: expected one message", field="request")
        except BaseException:
            if account is not None:
                self._release(caller, account, reserve)
            raise
        if account is None:
            return request, None
        size = min(request.ByteSize(), reserve)
        # The reservation's unused part held no memory: not a reason to trim the heap.
        self._release(caller, account, reserve - size, freed=False)
        return request, lambda: self._release(caller, account, size)


def _host(peer: str) -> str:
    """The host of a gRPC peer ("ipv4:10.0.0.7:5123", "ipv6:[::1]:5123", "unix:...")."""
    return peer.rpartition(":")[0] or peer


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


Read = Callable[[AsyncIterator[Any], Any], Awaitable[tuple[Any, Release | None]]]


def _unary(handler: grpc.RpcMethodHandler, read: Read) -> grpc.RpcMethodHandler:
    async def one(requests: AsyncIterator[Any], context: Any) -> tuple[Any, Release | None]:
        try:
            return await read(requests, context)
        except OmniError as exc:
            await abort_rpc(context, exc)

    if handler.response_streaming:
        inner_us = handler.unary_stream

        async def unary_stream(requests: AsyncIterator[Any], context: Any) -> Any:
            request, release = await one(requests, context)
            outputs = replies(inner_us(request, context))
            # The handler holds the message as long as it needs it, and no longer:
            # a long call must not keep a large one alive here.
            del request
            try:
                async for reply in outputs:
                    yield reply
            finally:
                if release is not None:
                    release()

        return grpc.stream_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    inner_uu = handler.unary_unary

    async def unary_unary(requests: AsyncIterator[Any], context: Any) -> Any:
        request, release = await one(requests, context)
        try:
            return await inner_uu(request, context)
        finally:
            if release is not None:
                release()

    return grpc.stream_unary_rpc_method_handler(
        unary_unary, handler.request_deserializer, handler.response_serializer
    )
