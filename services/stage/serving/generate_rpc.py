"""One Generate stream: Submits, chunks and Cancels in, every request's events out.

Several requests share a stream; an error ends one request, never the stream.
On a stream a request id names one request from its first Submit to its final
event. A message that breaks that request's input (a second Submit with
sequence 0, a window out of order, a window after ``is_last``, a bad window)
ends the request with INVALID_ARGUMENT naming the field: that Error is its one
final event. A Submit for an id in flight on another stream is refused on its
own stream only. A Cancel (or ``input_ended``) of an id with nothing in flight on
this stream is answered with Error NOT_FOUND, unless the stream has just sent
that id its final event: then it crossed that event on the wire and is dropped,
as a Credit is (a second final event would end the id twice). A frame that is
not a StageInput at all ends the whole RPC with INVALID_ARGUMENT
(``UndecodableFrame``).

This module is the stream's input side: a Submit is read (``convert``), its
inputs decoded and joined (``inputs``, ``transforms``), and the request planned
and started on the runtime, which emits its events to this stream's
``StreamEmitter`` (``outputs``, the output side: a bounded queue, so a client
that stops reading holds its requests' producers). A request whose first Submit
sets a credit sends Segments and Progress only while it has credit; the Credits
the client sends, read here, resume it. ``Submit.timeout_ms`` ends one request
DEADLINE_EXCEEDED; ``Submit.input_ended`` is a half-close for one request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from services.engines.base import EngineRequest, SamplingParams
from services.engines.capabilities import accepted_kinds
from services.mesh.data.chunk_wire import ChunkFrame, EncodedChunk
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    OmniError,
)
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.decoding import UndecodableFrame
from services.mesh.rpc.request_ids import check_request_id
from services.stage.serving import convert
from services.stage.serving.content import Intake
from services.stage.serving.convert import SubmitIn
from services.stage.serving.frames import InputFrame
from services.stage.serving.inputs import Inputs, InputWindows, decode, input_bytes
from services.stage.serving.outputs import StreamEmitter
from services.stage.serving.requests import InputFeed, OutputCredit, RequestRecord
from services.stage.serving.runtime import StageRuntime
from services.stage.serving.tensor_io import StageTensors
from services.stage.serving.transforms import apply_transform, check_transform

logger = logging.getLogger(__name__)


class GenerateStream:
    def __init__(self, runtime: StageRuntime, tensors: StageTensors) -> None:
        self._runtime = runtime
        self._requests = runtime.requests
        self._tensors = tensors
        limits = runtime.config.runtime
        # One account for all this stream holds: unfinished chunks and its requests' inputs.
        self._account = runtime.budget.account(limits.max_input_bytes)
        self._chunks = ChunkAssembler(limits.max_input_bytes, self._account)
        self._emitter = StreamEmitter(runtime, tensors)
        self._intake = Intake(runtime.config.name, accepted_kinds(runtime.engine))
        self._fatal: OmniError | None = None
        self._expiring: set[asyncio.Task[None]] = set()

    async def run(
        self, inputs: AsyncIterator[InputFrame]
    ) -> AsyncIterator[stage_pb2.StageOutput | EncodedChunk]:
        """The stream's outputs; raises OmniError when the RPC itself must fail."""
        reader = asyncio.create_task(self._read(inputs), name="generate-reader")
        try:
            async for item in self._emitter.outputs():
                yield item
            if self._fatal is None:
                await reader
        finally:
            # Client gone (or stream done): nothing it started may keep running.
            reader.cancel()
            self._runtime.drop_stream(self._emitter)
            await asyncio.gather(reader, return_exceptions=True)
            # Its requests gave their bytes back as they left; chunks nobody claimed go now.
            self._chunks.discard_all()
            self._account.close()
        if self._fatal is not None:
            raise self._fatal

    async def _read(self, inputs: AsyncIterator[InputFrame]) -> None:
        try:
            async for message in inputs:
                try:
                    await self._handle(message)
                except Exception:
                    # A bug handling one message must not end the stream for the others.
                    logger.exception("stage %s: input message failed", self._runtime.config.name)
                    rid = (
                        message.submit.request_id
                        if isinstance(message, stage_pb2.StageInput) and message.HasField("submit")
                        else ""
                    )
                    await self._refuse(rid, OmniError("internal error handling this input"))
            # The client stopped sending: what came is all there is.
            for record in self._requests.of_stream(self._emitter):
                await self._input_ended(record)
        except UndecodableFrame as exc:  # the RPC itself fails, now
            self._fatal = exc
            await self._emitter.end_now()
        finally:
            await self._emitter.input_closed()

    async def _input_ended(self, record: RequestRecord) -> None:
        """No more input for ``record``: a streaming-input request runs on what
        came; any other still waiting for its last window ends INVALID_ARGUMENT."""
        if record.final or record.input_done:
            return
        if record.feed is not None:
            record.input_done = True
            await record.feed.close()
        else:
            missing = InvalidArgument(
                f"submit.is_last: the input of request {record.request_id!r} ended before"
                " its last window",
                field="submit.is_last",
            )
            await self._runtime.end(record, missing)

    async def _handle(self, message: stage_pb2.StageInput | ChunkFrame) -> None:
        kind = message.WhichOneof("kind")
        if kind == "chunk":
            try:
                self._chunks.add(message.chunk)
            except OmniError as exc:
                await self._emitter.refuse("", exc)
        elif isinstance(message, ChunkFrame):
            raise AssertionError("a ChunkFrame holds a chunk")
        elif kind == "submit":
            await self._submit(message.submit)
        elif kind == "cancel":
            await self._cancel(message.cancel.request_id)
        elif kind == "credit":
            # An id not in flight here: the Credit crossed its final event.
            record = self._on_this_stream(message.credit.request_id)
            if record is not None and record.credit is not None:
                record.credit.grant(message.credit.outputs)
        else:
            await self._emitter.refuse(
                "",
                InvalidArgument("input: expected submit, chunk, cancel or credit", field="input"),
            )

    async def _cancel(self, request_id: str) -> None:
        record = self._on_this_stream(request_id)
        if record is None and self._emitter.finished(request_id):
            name = self._runtime.config.name
            logger.debug("stage %s: a Cancel of %r crossed its final event", name, request_id)
            return
        if record is None:
            error = NotFound(
                f"cancel.request_id: no request {request_id!r} in flight on this stream",
                field="cancel.request_id",
            )
            await self._emitter.refuse(request_id, error)
            return
        await self._runtime.end(record, Cancelled(f"request {request_id}: cancelled by the client"))

    def _on_this_stream(self, request_id: str) -> RequestRecord | None:
        record = self._requests.live(request_id)
        return record if record is not None and record.emitter is self._emitter else None

    async def _submit(self, message: stage_pb2.Submit) -> None:
        submit = convert.read_submit(message)
        rid = submit.request_id
        if submit.input_ended:
            record = self._on_this_stream(rid)
            if record is not None:
                await self._input_ended(record)
            elif not self._emitter.finished(rid):  # as an unknown Cancel: its one final event
                error = NotFound(
                    f"submit.input_ended: no request {rid!r} in flight on this stream",
                    field="submit.input_ended",
                )
                await self._emitter.refuse(rid, error)
            return
        try:
            check_request_id(rid, "submit.request_id")
            record = self._on_this_stream(rid)
            if record is None:
                self._not_elsewhere(rid)
            convert.check_submit(message, self._runtime.config.runtime)
            if record is None:
                await self._first(submit)
            else:
                await self._next(record, submit)
        except OmniError as exc:
            await self._refuse(rid, exc)

    def _not_elsewhere(self, rid: str) -> None:
        if self._requests.live(rid) is not None:
            raise InvalidArgument(
                f"submit.request_id: {rid!r} is already in flight on stage "
                f"{self._runtime.config.name} (on another stream)",
                field="submit.request_id",
            )

    async def _refuse(self, request_id: str, error: OmniError) -> None:
        """One final event for ``request_id``: ending it if it is in flight here."""
        record = self._on_this_stream(request_id) if request_id else None
        if record is not None:
            await self._runtime.end(record, error)
        else:
            await self._emitter.refuse(request_id, error)

    async def _first(self, submit: SubmitIn) -> None:
        rid = submit.request_id
        runtime = self._runtime
        if submit.sequence != 0:
            raise InvalidArgument(
                f"submit.sequence: request {rid!r} expected 0, got {submit.sequence}",
                field="submit.sequence",
            )
        check_transform(submit.transform)
        params = self._params(submit)
        inputs = await self._decode(submit)
        self._not_elsewhere(rid)  # again: another stream may have taken the id meanwhile
        held = self._account.hold()
        held.add(input_bytes(inputs), "inputs")  # nothing kept yet if this is refused
        record = RequestRecord(
            request_id=rid,
            emitter=self._emitter,
            consumer=submit.consumer,
            transform=submit.transform,
            params=params,
            windows=InputWindows(rid, runtime.config.runtime.max_input_windows),
            held=held,
            trace_context=submit.trace_context,
            credit=OutputCredit(submit.credit) if submit.credit else None,
        )
        if submit.timeout_ms:
            record.deadline = asyncio.get_running_loop().call_later(
                submit.timeout_ms / 1e3, self._expire, record, submit.timeout_ms
            )
        streaming = not submit.is_last and runtime.config.runtime.streaming_input
        # Kept only while the request waits for the rest of its input.
        record.windows.add(None if submit.is_last or streaming else inputs)
        if submit.is_last:
            record.input_done = True
            self._requests.add(record)
            await runtime.start(record, await self._request(record, inputs))
        elif streaming:
            # A request under credit may pause with its feed full: the stream's
            # reader must not wait on it, or no Credit (its own included) gets read.
            record.feed = InputFeed(depth=0 if record.credit is not None else 4)
            self._requests.add(record)
            more = record.feed.windows()
            await runtime.start(record, await self._request(record, inputs), more=more)
        else:
            self._requests.add(record)

    async def _next(self, record: RequestRecord, submit: SubmitIn) -> None:
        """A later window of a request in flight on this stream."""
        rid = record.request_id
        if submit.sequence == 0:
            record.windows.expect(0)  # a second first Submit: refused as a duplicate
        if record.input_done:
            raise InvalidArgument(
                f"submit.sequence: request {rid!r} already sent its last window (is_last)",
                field="submit.sequence",
            )
        record.windows.expect(submit.sequence)
        if record.feed is None:
            record.windows.check_room()  # before decoding what could not be kept
        inputs = await self._decode(submit)
        if record.feed is not None:
            # Not charged: the feed holds at most a few windows, and holds the sender back.
            if not inputs.empty:  # an empty last window only ends the input
                window = await self._request(record, inputs, self._params(submit))
                await record.feed.put(await self._runtime.prepare(window))
            record.windows.add(None)
            if submit.is_last:
                record.input_done = True
                await record.feed.close()
            return
        assert record.held is not None
        record.held.add(input_bytes(inputs), "inputs")
        record.windows.add(inputs)
        if submit.is_last:
            record.input_done = True
            await self._runtime.start(record, await self._request(record, None))

    def _expire(self, record: RequestRecord, timeout_ms: int) -> None:
        error = DeadlineExceeded(
            f"request {record.request_id}: its deadline ({timeout_ms} ms) passed on stage "
            f"{self._runtime.config.name}"
        )
        task = asyncio.create_task(self._runtime.end(record, error))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    def _params(self, submit: SubmitIn) -> SamplingParams:
        runtime = self._runtime
        supported = runtime.engine.supported_params
        return convert.sampling_params(submit.params, supported, runtime.config.engine)

    async def _decode(self, submit: SubmitIn) -> Inputs:
        """Tensors decoded (chunked ones taken whole from this stream's assembler,
        refs opened, pieces joined: copies of up to ``max_input_bytes``): in a
        thread, while this stream's reader waits, so no other stream does."""

        def run() -> Inputs:
            return decode(
                submit.inputs,
                self._tensors.receiver,
                self._chunks,
                request_id=submit.request_id,
                intake=self._intake,
            )

        if not submit.inputs.tensors and not any(m.parts for m in submit.inputs.messages):
            return run()  # text, messages, ids (at most max_prompt_tokens): no thread needed
        return await asyncio.to_thread(run)

    @staticmethod
    async def _request(
        record: RequestRecord, inputs: Inputs | None, params: SamplingParams | None = None
    ) -> EngineRequest:
        """The engine's request: whole inputs (``None``: the request's windows joined),
        then the request's transform; in a thread, as joining and transforms copy tensors."""

        def run() -> EngineRequest:
            whole = record.windows.whole() if inputs is None else inputs
            whole = apply_transform(record.transform, whole)
            return convert.engine_request(record.request_id, whole, params or record.params)

        if inputs is not None and not inputs.tensors:
            return run()  # nothing to join or copy: a thread hop would cost more
        return await asyncio.to_thread(run)
