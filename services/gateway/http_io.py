"""The HTTP side of one call: its body read within the size limit, its bearer
token (passed on to the orchestrator as it came), and a watch for the client
going away before the answer is ready, so its request is cancelled in the mesh."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.requests import HTTPConnection, Request

from services.gateway.errors import ApiError


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past ``limit`` bytes before more of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")


def bearer_token(request: HTTPConnection) -> str | None:
    """The caller's ``Authorization: Bearer`` token (None without one). The
    orchestrator decides whether it is known; gRPC metadata takes only printable
    ASCII, so anything else is refused here."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "expected 'Authorization: Bearer TOKEN'", code="invalid_api_key")
    if not (token.isascii() and token.isprintable()):
        raise ApiError(401, "the bearer token is not printable ASCII", code="invalid_api_key")
    return token


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(
    request: Request, cancel: Callable[[], object]
) -> AsyncIterator[Callable[[], bool]]:
    """While inside, a client that disconnects calls ``cancel``; yields whether it
    did. For the time before a response starts (a stream's response watches
    for itself once it has). Call only once the body has been read."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        cancel()

    task = asyncio.create_task(watch())
    try:
        yield gone.is_set
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
