"""/v1/realtime: a WebSocket per session. One task reads client events and
hands them to the session in order; one writes its server events (outbox.py).
The gateway's limits end a session with an ``error`` event and a close code:

    1013  the gateway holds --max-sessions sessions already
    1008  the client stopped reading (--max-unread-bytes), or its model or
          token was refused
    1001  idle: no client event and no response for --session-idle-s
    1009  a message over --max-event-bytes (uvicorn's own, without an event)

A refused event is answered with ``error`` and the session goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
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


class Sessions:
    """The gateway's sessions: counted against --max-sessions."""

    def __init__(self, context: Context, catalog: Catalog) -> None:
        self.context = context
        self.catalog = catalog
        self.open = 0

    async def serve(self, websocket: WebSocket) -> None:
        limits = self.context.limits
        await websocket.accept()
        outbox = Outbox(websocket, limits.max_unread_bytes)
        writer = asyncio.create_task(outbox.write(), name="realtime writer")
        session: Session | None = None
        counted = False
        try:
            if self.open >= limits.max_sessions:
                failure = ApiError(
                    429,
                    f"the gateway serves {limits.max_sessions} sessions at once; try again later",
                    code="session_limit_reached",
                )
                await _close(websocket, outbox, failure, FULL)
                return
            self.open += 1
            counted = True
            try:
                pipeline = await self._pipeline(websocket)
            except ApiError as exc:
                await _close(websocket, outbox, exc, POLICY)
                return
            token = bearer_token(websocket)
            session = Session(self.context, pipeline, token, outbox.put)
            outbox.put({"type": "session.created", "session": session.view()})
            await self._read(websocket, session, outbox)
        except WebSocketDisconnect:
            pass
        finally:
            if session is not None:
                session.close()
            if counted:
                self.open -= 1
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    async def _pipeline(self, websocket: WebSocket) -> Pipeline:
        try:
            token = bearer_token(websocket)
            return await self.catalog.model(websocket.query_params.get("model"), token)
        except grpc.aio.AioRpcError as exc:
            raise ApiError.from_rpc(exc) from None

    async def _read(self, websocket: WebSocket, session: Session, outbox: Outbox) -> None:
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
                    logger.info("session %s: the client stopped reading; closed", session.id)
                    failure = ApiError(
                        400,
                        f"the client left over {limits.max_unread_bytes} bytes of events unread",
                        code="client_too_slow",
                    )
                    await _close(websocket, outbox, failure, POLICY, drained=False)
                    return
                if not done:
                    receiving.cancel()
                    if session.busy:
                        continue
                    failure = ApiError(
                        408, f"no event for {limits.idle_s:g} s", code="session_idle_timeout"
                    )
                    await _close(websocket, outbox, failure, IDLE)
                    return
                message = receiving.result()
                if message["type"] == "websocket.disconnect":
                    return
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


async def _close(
    websocket: WebSocket, outbox: Outbox, failure: ApiError, code: int, *, drained: bool = True
) -> None:
    """Say why (an ``error`` event, when the client still reads), then close."""
    if drained:
        outbox.put(wire.error(failure))
        await outbox.drain(CLOSE_GRACE_S)
    if websocket.application_state != WebSocketState.DISCONNECTED:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(websocket.close(code, failure.code), CLOSE_GRACE_S)
