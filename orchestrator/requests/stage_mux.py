"""Long-lived Generate streams to the stages, shared by every request.

Each stage gets a small pool of streams (one per replica address its target
names, else one), each opened at its first turn and kept open: a request's
Submits, Credits and Cancels for that stage go on one of them, and a reader per
stream hands each output to its request by id. Opening a stream per request
per stage cost more than the messages themselves (issue 11).

Flow control is per request (``Submit.credit``): a request starts with
``CREDIT`` outputs and its flow grants them back as it takes what came, so a
request whose consumer is slow pauses on the stage alone while the others on
the stream go on, and what waits here for it stays bounded. A stream that
breaks (the stage restarted, a reset, UNAVAILABLE) fails the requests on it,
each with ``StreamBroken``; the next request opens a new one. Stopping one
request sends its Cancel on the shared stream, never cancels the stream.
A stream older than ``MAX_AGE_S`` takes no new requests and is half-closed
after its last one, so the target is resolved again (new replicas are found).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import grpc

from orchestrator.requests.errors import StreamBroken
from services.mesh.data.chunk_wire import EncodedChunk
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.errors import OmniError
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient

logger = logging.getLogger(__name__)

CREDIT = 16  # outputs a request may have on their way before its flow takes them
GRANT_EVERY = 8  # outputs taken before they are granted back, in one Credit
MAX_AGE_S = 60.0  # below the stages' 120 s connection age (their GOAWAY)
MAX_CHUNKED_BYTES = 4 << 30  # chunked tensors awaiting their segment, per stream
CLOSING_WAIT_S = 5.0  # a reused id waits this long for its cancelled namesake's end
_FINAL = ("completed", "error")
_CREDITED = ("segment", "progress")


# Errors for a control message that crossed its request's final event on the wire.
_CROSSING = frozenset({"cancel.request_id", "submit.input_ended"})


def pool_size(address: str) -> int:
    """Streams per stage: one per address an ``ipv4:``/``ipv6:`` target lists; a
    ``dns:`` target may name any number of replicas behind one name, so a few."""
    scheme, _, rest = address.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return max(len(rest.split(",")), 1)
    if scheme == "dns":
        return 4
    return 1


class RequestStream:
    """One request's share of a stage stream: its writes, its outputs, its credit."""

    def __init__(self, stream: _Stream, request_id: str) -> None:
        self.request_id = request_id
        self._stream = stream
        self._queue: asyncio.Queue[stage_pb2.StageOutput | OmniError] = asyncio.Queue()
        self._owed = 0  # taken outputs not yet granted back
        self._sent = False
        self._closed = False
        self.final = False

    @property
    def buffered(self) -> int:
        """Outputs that came for this request and its flow has not read yet."""
        return self._queue.qsize()

    async def write(self, message: stage_pb2.StageInput | EncodedChunk) -> None:
        """Send on the shared stream (the first Submit carries the request's credit:
        ``submits``)."""
        self._sent = True
        await self._stream.write(message)

    def post(self, message: stage_pb2.StageInput) -> None:
        """Send without waiting for the write (a request's last Submit, whole): in
        order after what came before; if the stream breaks, ``read`` says so."""
        self._sent = True
        self._stream.post(message)

    async def read(self) -> stage_pb2.StageOutput:
        """The request's next output; raises StreamBroken (or an OmniError from
        assembling its chunks) when there will be no more."""
        item = await self._queue.get()
        if isinstance(item, OmniError):
            raise item
        return item

    def taken(self, output: stage_pb2.StageOutput) -> None:
        """The flow has handed ``output`` on: its credit goes back to the stage."""
        if output.WhichOneof("kind") not in _CREDITED or self.final:
            return
        self._owed += 1
        if self._owed >= GRANT_EVERY:
            credit = stage_pb2.Credit(request_id=self.request_id, outputs=self._owed)
            self._owed = 0
            self._stream.post(stage_pb2.StageInput(credit=credit))

    def deliver(self, item: stage_pb2.StageOutput | OmniError) -> None:
        self._queue.put_nowait(item)

    def close(self) -> None:
        """The request is done with this stage: if the stage has not ended it,
        it is cancelled on the shared stream (the stream goes on)."""
        if self._closed:
            return
        self._closed = True
        self._stream.leave(self, cancel=self._sent and not self.final)


class _Stream:
    """One Generate call: a writer task owns its writes, a reader task routes its outputs."""

    def __init__(self, stage: str, client: StageClient) -> None:
        self.stage = stage
        self.opened_at = time.monotonic()
        self.retired = False
        self.broken: StreamBroken | None = None
        # Opened only for a stage its monitor says is READY; the channel may still
        # be reconnecting to it (a restarted stage): the stream waits for that.
        self._call = client.open_stream(wait_for_ready=True)
        self._outbox: asyncio.Queue[
            tuple[stage_pb2.StageInput | EncodedChunk, asyncio.Future[None] | None] | None
        ] = asyncio.Queue()
        self._requests: dict[str, RequestStream] = {}
        # Cancelled requests whose final event has not come back yet.
        self.closing: dict[str, asyncio.Event] = {}
        self._assembler = ChunkAssembler(MAX_CHUNKED_BYTES)
        self._writer = asyncio.create_task(self._write(), name=f"stream-writer@{stage}")
        self._reader = asyncio.create_task(self._read(), name=f"stream-reader@{stage}")

    def join(self, request_id: str) -> RequestStream:
        request = RequestStream(self, request_id)
        self._requests[request_id] = request
        return request

    async def write(self, message: stage_pb2.StageInput | EncodedChunk) -> None:
        if self.broken is not None:
            raise self.broken.again()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outbox.put_nowait((message, done))
        await done

    def post(self, message: stage_pb2.StageInput) -> None:
        """Send without waiting (Credit, Cancel): in order after what came before."""
        if self.broken is None:
            self._outbox.put_nowait((message, None))

    def leave(self, request: RequestStream, cancel: bool) -> None:
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        if cancel and self.broken is None:
            self.closing[request.request_id] = asyncio.Event()
            self.post(stage_pb2.StageInput(cancel=stage_pb2.Cancel(request_id=request.request_id)))
        self._finish_if_idle()

    def retire(self) -> None:
        """Take no new requests; half-close once the last one has ended."""
        self.retired = True
        self._finish_if_idle()

    def _finish_if_idle(self) -> None:
        if self.retired and not self._requests and not self.closing and self.broken is None:
            self._outbox.put_nowait(None)

    async def _write(self) -> None:
        while (item := await self._outbox.get()) is not None:
            message, done = item
            try:
                await self._call.write(message)
            except Exception as exc:  # the call is over: the reader says why
                logger.debug("stage %s: a write on its stream failed: %r", self.stage, exc)
                error = StreamBroken(grpc.StatusCode.UNAVAILABLE, "its stream broke")
                if done is not None and not done.done():
                    done.set_exception(error.again())
                self._fail_writes(error)
                return
            if done is not None and not done.done():
                done.set_result(None)
        if self.broken is None:  # retired and idle: the stage ends the stream in turn
            try:
                await self._call.done_writing()
            except Exception as exc:
                logger.debug("stage %s: half-closing its stream failed: %r", self.stage, exc)

    def _fail_writes(self, error: StreamBroken) -> None:
        while not self._outbox.empty():
            item = self._outbox.get_nowait()
            if item is not None and item[1] is not None and not item[1].done():
                item[1].set_exception(error.again())

    async def _read(self) -> None:
        try:
            while (output := await self._call.read()) is not grpc.aio.EOF:
                self._route(output)
            broken = StreamBroken(grpc.StatusCode.UNAVAILABLE, "the stage ended its stream")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            # The stream is only cancelled here when the orchestrator stops.
            code = grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.CANCELLED else code
            broken = StreamBroken(code, exc.details() or "the stream broke")
        self._break(broken)

    def _route(self, output: stage_pb2.StageOutput) -> None:
        kind = output.WhichOneof("kind")
        if kind == "chunk":
            try:
                self._assembler.add(output.chunk)
            except OmniError as exc:  # its segment will not resolve: that request fails
                logger.warning("stage %s: a tensor chunk was refused: %s", self.stage, exc.message)
            return
        rid = getattr(output, kind).request_id
        request = self._requests.get(rid)
        if request is None:
            closing = self.closing.get(rid)
            crossed = kind == "error" and output.error.field in _CROSSING
            if closing is None and crossed:
                # A Cancel (or end of input) that crossed its request's final event.
                logger.debug("stage %s: request %r had ended before its Cancel", self.stage, rid)
            elif closing is None:
                logger.warning(
                    "stage %s: %s for request %r, which is not on this stream: dropped",
                    self.stage,
                    kind,
                    rid,
                )
            elif kind in _FINAL:
                del self.closing[rid]
                closing.set()
                self._finish_if_idle()
            return
        if kind == "segment":
            try:
                self._assembler.resolve(output.segment.tensors, "segment.tensors")
                self._assembler.resolve_blobs(output.segment.blobs, "segment.blobs")
            except OmniError as exc:
                request.deliver(exc)
                return
        if kind in _FINAL:
            request.final = True
            del self._requests[rid]
        request.deliver(output)

    def _break(self, broken: StreamBroken) -> None:
        if self.broken is not None:
            return
        self.broken = broken
        if self._requests:
            logger.warning(
                "stage %s: its stream broke (%s); failing %d request(s) on it",
                self.stage,
                broken,
                len(self._requests),
            )
        for request in self._requests.values():
            request.deliver(broken.again())
        self._requests.clear()
        for event in self.closing.values():
            event.set()
        self.closing.clear()
        self._fail_writes(broken)
        self._outbox.put_nowait(None)

    async def close(self) -> None:
        self._call.cancel()
        self._break(StreamBroken(grpc.StatusCode.UNAVAILABLE, "the orchestrator is stopping"))
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


class StageStreams:
    """The shared streams of every stage, opened on first use and reopened when broken."""

    def __init__(self, clients: Mapping[str, StageClient]) -> None:
        self._clients = clients
        self._pools: dict[str, list[_Stream | None]] = {}
        self._turn: dict[str, int] = {}
        self._retired: set[_Stream] = set()
        self.opened: dict[str, int] = {}  # streams opened per stage, ever

    async def join(self, stage: str, request_id: str) -> RequestStream:
        """``request_id``'s share of one of ``stage``'s streams."""
        pool = self._pool(stage)
        for slot in pool:  # an id reused at once: its cancelled namesake ends first
            closing = None if slot is None else slot.closing.get(request_id)
            if closing is not None:
                try:
                    await asyncio.wait_for(closing.wait(), CLOSING_WAIT_S)
                except TimeoutError:
                    logger.warning("stage %s: request %r reused before its end", stage, request_id)
        turn = self._turn[stage] = (self._turn.get(stage, -1) + 1) % len(pool)
        stream = pool[turn]
        if stream is None:
            stream = pool[turn] = self._open(stage)
        elif stream.broken is not None or time.monotonic() - stream.opened_at > MAX_AGE_S:
            if stream.broken is None:
                stream.retire()
                self._retired.add(stream)
            stream = pool[turn] = self._open(stage)
        return stream.join(request_id)

    def _pool(self, stage: str) -> list[_Stream | None]:
        pool = self._pools.get(stage)
        if pool is None:
            # Each slot opens at its first turn, not all at once: round_robin then
            # picks each stream among the replicas ready by then (the first request
            # may come when one replica's health is known and another's not yet).
            size = pool_size(self._clients[stage].address)
            pool = self._pools[stage] = [None] * size
        return pool

    def _open(self, stage: str) -> _Stream:
        self.opened[stage] = self.opened.get(stage, 0) + 1
        self._retired = {s for s in self._retired if s.broken is None}
        return _Stream(stage, self._clients[stage])

    async def close(self) -> None:
        streams = [s for pool in self._pools.values() for s in pool if s is not None]
        streams += list(self._retired)
        self._pools.clear()
        self._retired.clear()
        await asyncio.gather(*(s.close() for s in streams))
