"""One long-lived Generate stream to one replica, shared by the requests on it.

A writer task owns the call's writes (in order: Submits, Credits, Cancels of
every request on it) and a reader task hands each output to its request
(``request_stream``) by id, joining tensor chunks into their segment first.
Stopping one request sends its Cancel on the stream, never cancels the stream.
A stream that breaks (the replica restarted or died, a reset, UNAVAILABLE)
fails the requests on it, each with ``StreamBroken``, except one that may move
(``RequestStream.movable``): ``stage_mux`` posts that one to another replica. So
does a request the replica refused as not serving (``Error.not_serving``: it
is draining, say, and its health has not said so yet). A retired stream takes no
new requests and is half-closed after its last one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from orchestrator.server.requests.errors import StreamBroken
from orchestrator.server.requests.request_stream import RequestStream
from orchestrator.server.stages.replica import Replica
from services.mesh.data.chunk_wire import EncodedChunk
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.errors import OmniError
from services.mesh.pb.omni.v1 import stage_pb2

logger = logging.getLogger(__name__)

MAX_CHUNKED_BYTES = 4 << 30  # chunked tensors awaiting their segment, per stream
CLOSING_WAIT_S = 5.0  # a reused id waits this long for its cancelled namesake's end
_FINAL = ("completed", "error")

# Errors for a control message that crossed its request's final event on the wire.
_CROSSING = frozenset({"cancel.request_id", "submit.input_ended"})


class ReplicaStream:
    """One Generate call to one replica: a writer task owns its writes, a reader
    task routes its outputs. ``move`` takes a request that may go elsewhere when
    the stream breaks (True: it went); ``refused`` one the replica refused as not
    serving, with why (True: it went)."""

    def __init__(
        self,
        replica: Replica,
        move: Callable[[RequestStream, Replica], bool],
        refused: Callable[[RequestStream, Replica, str], bool],
    ) -> None:
        self.replica = replica
        self.stage = stage = replica.stage
        client = replica.client
        self._move = move
        self._refused = refused
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
            del self._requests[rid]
            if kind == "error" and self._moved_on_refusal(request, output.error):
                return
            request.final = True
        request.deliver(output)

    def _moved_on_refusal(self, request: RequestStream, error: stage_pb2.Error) -> bool:
        """A request the replica refused as not serving before any of it ran goes to
        another replica if it may move (True: it went)."""
        if not (error.not_serving and request.movable):
            return False
        if not self._refused(request, self.replica, error.message):
            return False
        self._finish_if_idle()
        return True

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
