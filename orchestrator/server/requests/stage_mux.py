"""Requests multiplexed over the shared streams of every replica of every stage.

Each replica (``stages.replica``) gets one stream (``replica_stream``), opened
at its first request and kept open: a request's Submits, Credits and Cancels
for that stage go on the stream of the replica its stage's ReplicaSet picked
(the least busy READY one), as its share of it (``request_stream``). Opening a
stream per request per stage cost more than the messages themselves (issue 11).

When a stream breaks, a request the replica had said nothing of whose only
Submit is still in hand moves to another READY replica; the next request opens
a new stream. So does such a request the replica refused as not serving
(draining before its health said so): the replica takes no new request until
its health says it serves. A replica found DOWN fails (or moves) what it held
at once, not when keepalive notices. A stream older than ``MAX_AGE_S`` takes no
new requests and is half-closed after its last one (the stage's connection age
ends it otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import grpc

from orchestrator.server.requests.errors import StageFailed, StreamBroken
from orchestrator.server.requests.replica_stream import CLOSING_WAIT_S, ReplicaStream
from orchestrator.server.requests.request_stream import RequestStream
from orchestrator.server.stages.replica import Replica
from orchestrator.server.stages.replicas import NoReplica, ReplicaSet

logger = logging.getLogger(__name__)

MAX_AGE_S = 60.0  # below the stages' 120 s connection age (their GOAWAY)


class StageStreams:
    """The shared streams of every replica of every stage, opened on first use and
    reopened when broken; each new request goes to the replica its stage picks."""

    def __init__(self, replicas: Mapping[str, ReplicaSet]) -> None:
        self._replicas = replicas
        self._streams: dict[Replica, ReplicaStream] = {}
        self._retired: set[ReplicaStream] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self.opened: dict[str, int] = {}  # streams opened per stage, ever
        self._stopping = False
        for replica_set in replicas.values():
            replica_set.on_lost(self._lost)
            replica_set.on_gone(self._gone)

    async def join(self, stage: str, request_id: str, affinity: str = "") -> RequestStream:
        """``request_id``'s share of the stream of the replica ``stage`` picks for it
        (``affinity``: its conversation's key); StageFailed (UNAVAILABLE) when no
        replica is READY within its wait."""
        for stream in [*self._streams.values(), *self._retired]:
            # An id reused at once: its cancelled namesake ends first.
            closing = stream.closing.get(request_id) if stream.stage == stage else None
            if closing is not None:
                try:
                    async with asyncio.timeout(CLOSING_WAIT_S):
                        await closing.wait()
                except TimeoutError:
                    logger.warning("stage %s: request %r reused before its end", stage, request_id)
        try:
            replica = await self._replicas[stage].pick(affinity=affinity)
        except NoReplica as exc:
            raise StageFailed(stage, grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        return self._stream(replica).join(request_id)

    def _stream(self, replica: Replica) -> ReplicaStream:
        """The replica's stream that takes new requests (opened, or reopened)."""
        stream = self._streams.get(replica)
        if stream is not None and stream.broken is None:
            if time.monotonic() - stream.opened_at <= MAX_AGE_S:
                return stream
            stream.retire()
            self._retired.add(stream)
        self.opened[replica.stage] = self.opened.get(replica.stage, 0) + 1
        self._retired = {s for s in self._retired if s.broken is None}
        stream = self._streams[replica] = ReplicaStream(replica, self._move, self._refused)
        return stream

    def _move(self, request: RequestStream, broken_at: Replica) -> bool:
        """A request the broken replica had said nothing of goes to another READY one."""
        return self._elsewhere(request, broken_at, "broke before it started")

    def _refused(self, request: RequestStream, replica: Replica, why: str) -> bool:
        """``replica`` refused ``request`` as not serving: it gets no new request
        until its health says it serves, and the request moves (True: it went)."""
        self._replicas[replica.stage].refused(replica, why)
        return self._elsewhere(request, replica, "refused it as not serving")

    def _elsewhere(self, request: RequestStream, left: Replica, how: str) -> bool:
        if self._stopping:
            return False
        replica = self._replicas[left.stage].choose_now(exclude=(left,))
        if replica is None:
            return False
        logger.info(
            "request %s: %s %s; moved to %s", request.request_id, left.name, how, replica.address
        )
        request.moved(self._stream(replica))
        return True

    def _lost(self, replica: Replica, why: str) -> None:
        """Nothing answers at the replica: what it held fails (or moves) now, not
        when keepalive notices."""
        stream = self._streams.pop(replica, None)
        if stream is not None:
            stream.fail(StreamBroken(grpc.StatusCode.UNAVAILABLE, f"{replica.name} is down: {why}"))
            self._close_later(stream)

    def _gone(self, replica: Replica) -> None:
        stream = self._streams.pop(replica, None)
        if stream is not None:
            self._close_later(stream)

    def _close_later(self, stream: ReplicaStream) -> None:
        task = asyncio.create_task(stream.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self._stopping = True
        streams = [*self._streams.values(), *self._retired]
        self._streams.clear()
        self._retired.clear()
        await asyncio.gather(*(s.close() for s in streams), *self._closing)
