"""Long-lived Generate streams to every replica of every stage, shared by every request.

Each replica (``stages.replicas``) gets one stream, opened at its first request
and kept open: a request's Submits, Credits and Cancels for that stage go on the
stream of the replica its stage's ReplicaSet picked (the least busy READY one),
and a reader per stream hands each output to its request by id. Opening a stream
per request per stage cost more than the messages themselves (issue 11).

Flow control is per request (``Submit.credit``): a request starts with
``CREDIT`` outputs and its flow grants them back as it takes what came, so a
request whose consumer is slow pauses on the stage alone while the others on
the stream go on, and what waits here for it stays bounded. A stream that
breaks (the replica restarted or died, a reset, UNAVAILABLE) fails the requests
on it, each with ``StreamBroken``, except one the replica had said nothing of
whose only Submit is still in hand: that one moves to another READY replica.
The next request opens a new stream. Stopping one request sends its Cancel on
the shared stream, never cancels the stream. A stream older than ``MAX_AGE_S``
takes no new requests and is half-closed after its last one (the stage's
connection age ends it otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import grpc

from orchestrator.requests.errors import StageFailed, StreamBroken
from orchestrator.stages.replicas import NoReplica, Replica, ReplicaSet
from services.mesh.data.chunk_wire import EncodedChunk
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.errors import OmniError
from services.mesh.pb.omni.v1 import stage_pb2

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


class RequestStream:
    """One request's share of a replica's stream: its writes, its outputs, its credit."""

    def __init__(self, stream: _Stream, request_id: str) -> None:
        self.request_id = request_id
        self._stream = stream
        self._queue: asyncio.Queue[stage_pb2.StageOutput | OmniError] = asyncio.Queue()
        self._owed = 0  # taken outputs not yet granted back
        self._sent = False
        self._closed = False
        self._heard = False  # the replica has sent something for it
        # Its one whole Submit, posted before anything else was sent: until the
        # replica says something of it, the request may move to another replica.
        self.replay: stage_pb2.StageInput | None = None
        self.final = False
        stream.replica.took()

    @property
    def replica(self) -> Replica:
        return self._stream.replica

    @property
    def address(self) -> str:
        """The replica's, as its errors name it."""
        return self._stream.replica.address

    @property
    def movable(self) -> bool:
        return self.replay is not None and not self._heard and not self._closed

    def moved(self, stream: _Stream) -> None:
        """Now on ``stream`` (another replica's): its Submit is posted there again."""
        assert self.replay is not None
        self._stream.replica.gave_back(heard=False)
        self._stream = stream
        stream.adopt(self)
        stream.replica.took()
        self._stream.post(self.replay)

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
        if not self._sent:
            self.replay = message
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
        if not self._heard:
            self._heard = True
            self.replay = None
            self._stream.replica.queued -= 1
        self._queue.put_nowait(item)

    def close(self) -> None:
        """The request is done with this stage: if the stage has not ended it,
        it is cancelled on the shared stream (the stream goes on)."""
        if self._closed:
            return
        self._closed = True
        self.replay = None
        self._stream.replica.gave_back(self._heard)
        self._stream.leave(self, cancel=self._sent and not self.final)


class _Stream:
    """One Generate call to one replica: a writer task owns its writes, a reader
    task routes its outputs. ``move`` takes a request that may go elsewhere when
    the stream breaks (True: it went)."""

    def __init__(self, replica: Replica, move: Callable[[RequestStream, Replica], bool]) -> None:
        self.replica = replica
        self.stage = stage = replica.stage
        client = replica.client
        self._move = move
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

    def adopt(self, request: RequestStream) -> None:
        self._requests[request.request_id] = request

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
            broken = StreamBroken(
                grpc.StatusCode.UNAVAILABLE, f"{self.replica.name} ended its stream"
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            # The stream is only cancelled here when the orchestrator stops.
            code = grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.CANCELLED else code
            details = exc.details() or "its stream broke"
            broken = StreamBroken(code, f"{self.replica.name}: {details}")
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

    def fail(self, broken: StreamBroken) -> None:
        """End the stream's requests with ``broken`` (or move them) and take no more."""
        self._call.cancel()
        self._break(broken)

    def _break(self, broken: StreamBroken) -> None:
        if self.broken is not None:
            return
        self.broken = broken
        requests = list(self._requests.values())
        self._requests.clear()
        failed = [r for r in requests if not (r.movable and self._move(r, self.replica))]
        if requests:
            logger.warning(
                "stage %s: the stream to %s broke (%s); %d request(s) on it moved, %d failed",
                self.stage,
                self.replica.address,
                broken,
                len(requests) - len(failed),
                len(failed),
            )
        for request in failed:
            request.deliver(broken.again())
        for event in self.closing.values():
            event.set()
        self.closing.clear()
        self._fail_writes(broken)
        self._outbox.put_nowait(None)

    async def close(self) -> None:
        self._call.cancel()
        self._break(StreamBroken(grpc.StatusCode.UNAVAILABLE, "the orchestrator is stopping"))
        # A write still waiting for a connection to a replica that is gone
        # (wait_for_ready) was seen to outlive its cancelled call: it is cut off.
        tasks = (self._writer, self._reader)
        _done, late = await asyncio.wait(tasks, timeout=CLOSING_WAIT_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StageStreams:
    """The shared streams of every replica of every stage, opened on first use and
    reopened when broken; each new request goes to the replica its stage picks."""

    def __init__(self, replicas: Mapping[str, ReplicaSet]) -> None:
        self._replicas = replicas
        self._streams: dict[Replica, _Stream] = {}
        self._retired: set[_Stream] = set()
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
                    await asyncio.wait_for(closing.wait(), CLOSING_WAIT_S)
                except TimeoutError:
                    logger.warning("stage %s: request %r reused before its end", stage, request_id)
        try:
            replica = await self._replicas[stage].pick(affinity=affinity)
        except NoReplica as exc:
            raise StageFailed(stage, grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        return self._stream(replica).join(request_id)

    def _stream(self, replica: Replica) -> _Stream:
        """The replica's stream that takes new requests (opened, or reopened)."""
        stream = self._streams.get(replica)
        if stream is not None and stream.broken is None:
            if time.monotonic() - stream.opened_at <= MAX_AGE_S:
                return stream
            stream.retire()
            self._retired.add(stream)
        self.opened[replica.stage] = self.opened.get(replica.stage, 0) + 1
        self._retired = {s for s in self._retired if s.broken is None}
        stream = self._streams[replica] = _Stream(replica, self._move)
        return stream

    def _move(self, request: RequestStream, broken_at: Replica) -> bool:
        """A request the broken replica had said nothing of goes to another READY one."""
        if self._stopping:
            return False
        replica = self._replicas[broken_at.stage].choose_now(exclude=(broken_at,))
        if replica is None:
            return False
        logger.info(
            "request %s: %s broke before it started; moved to %s",
            request.request_id,
            broken_at.name,
            replica.address,
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

    def _close_later(self, stream: _Stream) -> None:
        task = asyncio.create_task(stream.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self._stopping = True
        streams = [*self._streams.values(), *self._retired]
        self._streams.clear()
        self._retired.clear()
        await asyncio.gather(*(s.close() for s in streams), *self._closing)
