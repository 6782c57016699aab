"""/v1/realtime: a WebSocket per session. One task reads client events and
hands them to the session in order; one writes its server events (outbox.py).
The gateway's limits end a session with an ``error`` event and a close code:

    1013  the gateway holds --max-sessions sessions already
    1008  the client stopped reading (--max-unread-bytes)
    1001  idle: no client event and no response for --session-idle-s
    1009  a message over --max-event-bytes (uvicorn's own, without an event)

A model or token the gateway refuses is refused at the HTTP handshake, before
the WebSocket is accepted (404, 401: an OpenAI error body), so a client that
retries closed sessions does not retry a refusal. A refused event is answered
with ``error`` and the session goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

import grpc
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from services.gateway.catalog import Catalog, Pipeline
from services.gateway.errors import ApiError
from services.gateway.http_io import bearer_token
from services.gateway.realtime import client_events as ce
from services.gateway.realtime import wire
from services.gateway.realtime.outbox import Outbox
from services.gateway.realtime.session import Context, Session

logger = logging.getLogger(__name__)

FULL, POLICY, IDLE = 1013, 1008, 1001
CLOSE_GRACE_S = 2.0  # for the last events (the error saying why) before the close
# A stalled client gets this long to read again and be told why its session ends;
# past it the gateway lets go of the session (the socket flushes or dies alone).
STALLED_GRACE_S = 10.0


@dataclass(frozen=True)
class Ending:
    """Why the gateway ends a session: the error event, the close code."""

    failure: ApiError
    code: int
    stalled: bool = False  # the client stopped reading: what is queued is dropped


class Sessions:
    """The gateway's sessions: counted against --max-sessions."""

    def __init__(self, context: Context, catalog: Catalog) -> None:
        self.context = context
        self.catalog = catalog
        self.open = 0

    async def serve(self, websocket: WebSocket) -> None:
        requested = websocket.query_params.get("model")
        try:
            token = bearer_token(websocket)
            pipeline = await self.catalog.model(requested, token, realtime=True)
        except ApiError as exc:
            await _deny(websocket, exc)
            return
        except grpc.aio.AioRpcError as exc:  # e.g. a token the orchestrator refuses
            await _deny(websocket, ApiError.from_rpc(exc))
            return
        await websocket.accept()
        outbox = Outbox(websocket, self.context.limits.max_unread_bytes)
        writer = asyncio.create_task(outbox.write(), name="realtime writer")
        counted = False
        ending: Ending | None
        try:
            if self.open >= self.context.limits.max_sessions:
                ending = self._full()
            else:
                self.open += 1
                counted = True
                ending = await self._session(websocket, outbox, pipeline, token, requested)
            if ending is not None:
                await _end(websocket, outbox, writer, ending)
        except WebSocketDisconnect:
            pass
        finally:
            if counted:
                self.open -= 1
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    def _full(self) -> Ending:
        limit = self.context.limits.max_sessions
        message = f"the gateway serves {limit} sessions at once; try again later"
        return Ending(ApiError(429, message, code="session_limit_reached"), FULL)

    async def _session(
        self,
        websocket: WebSocket,
        outbox: Outbox,
        pipeline: Pipeline,
        token: str | None,
        requested: str | None,
    ) -> Ending | None:
        session = Session(self.context, pipeline, token, outbox.put, model=requested)
        outbox.put({"type": "session.created", "session": session.view()})
        try:
            return await self._read(websocket, session, outbox)
        finally:
            session.close()

    async def _read(self, websocket: WebSocket, session: Session, outbox: Outbox) -> Ending | None:
        limits = self.context.limits
        overflow = asyncio.create_task(outbox.overflowed.wait())
        try:
            while True:
                receiving = asyncio.create_task(websocket.receive())
                done, _ = await asyncio.wait(
                    {receiving, overflow},
                    timeout=limits.idle_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if overflow in done:
                    receiving.cancel()
                    logger.info("session %s: the client stopped reading; closing", session.id)
                    unread = (
                        f"the client left over {limits.max_unread_bytes} bytes of events unread"
                    )
                    return Ending(ApiError(400, unread, code="client_too_slow"), POLICY, True)
                if not done:
                    receiving.cancel()
                    if session.busy:
                        continue
                    idle = f"no event for {limits.idle_s:g} s"
                    return Ending(ApiError(408, idle, code="session_idle_timeout"), IDLE)
                message = receiving.result()
                if message["type"] == "websocket.disconnect":
                    return None
                await self._one(session, outbox, message.get("text") or message.get("bytes") or "")
        finally:
            overflow.cancel()

    async def _one(self, session: Session, outbox: Outbox, text: str | bytes) -> None:
        try:
            event = ce.parse(text)
        except ce.EventError as exc:
            outbox.put(wire.error(exc, exc.event_id))
            return
        try:
            await session.handle(event)
        except ApiError as exc:
            outbox.put(wire.error(exc, event.event_id))


async def _deny(websocket: WebSocket, failure: ApiError) -> None:
    """Refuse the handshake with ``failure`` as an HTTP response (its status and
    OpenAI error body); a server without the denial extension gets a close
    before accept, which the client sees as HTTP 403."""
    logger.info("realtime handshake refused: %s", failure.message)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(failure.body, failure.status))
    else:
        await websocket.close(POLICY, failure.code)


async def _end(
    websocket: WebSocket, outbox: Outbox, writer: asyncio.Task[None], ending: Ending
) -> None:
    """Say why (an ``error`` event), then close with the ending's code. A stalled
    client's unread events are dropped first: it is told as soon as it reads."""
    if ending.stalled:
        writer.cancel()  # waiting for the socket to drain, nothing half-sent
        outbox.discard()
        grace = STALLED_GRACE_S
    else:
        grace = CLOSE_GRACE_S
    outbox.put(wire.error(ending.failure), last=True)
    if ending.stalled:
        await _quietly(outbox.flush_one(websocket), grace)
    else:
        await outbox.drain(grace)
    if websocket.application_state != WebSocketState.DISCONNECTED:
        await _quietly(websocket.close(ending.code, ending.failure.code), grace)


async def _quietly(step: Awaitable[None], timeout_s: float) -> None:
    """``step`` within ``timeout_s``; a client gone or still stalled is let go."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(step, timeout_s)
