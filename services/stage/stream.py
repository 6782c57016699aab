"""One Generate stream: Submits and Cancels in, every request's events out.

Several requests share a stream; an error ends one request, never the stream.
The stream ends when the client has half-closed and every request it started
has reported its final event. Outputs go through a bounded queue, so a client
that stops reading holds its requests' producers (and HTTP/2 flow control
holds the client's writes in turn).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import torch

from services.engines.base import EngineRequest
from services.mesh import chunks
from services.mesh.chunks import ChunkAssembler
from services.mesh.errors import Cancelled, InvalidArgument, OmniError
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.stage import convert
from services.stage.events import CompletedOut, ErrorOut, SegmentOut, StageEvent
from services.stage.runtime import StageRuntime
from services.stage.tensor_io import StageTensors
from services.stage.transforms import apply_transform
from services.stage.windows import InputAssembler

logger = logging.getLogger(__name__)

_END = object()


class GenerateStream:
    def __init__(self, runtime: StageRuntime, tensors: StageTensors) -> None:
        self._runtime = runtime
        self._tensors = tensors
        self._chunks = ChunkAssembler(runtime.config.runtime.max_input_bytes)
        # Where each request's output tensors will be opened (Submit.consumer).
        self._consumers: dict[str, tensor_pb2.NodeIdentity | None] = {}
        self._out: asyncio.Queue[object] = asyncio.Queue(runtime.config.runtime.output_queue_size)
        self._mine: set[str] = set()
        self._assembler = InputAssembler()
        self._reading = True
        self._feeds: dict[str, _Feed] = {}
        self._ended = False

    async def run(
        self, inputs: AsyncIterator[stage_pb2.StageInput]
    ) -> AsyncIterator[stage_pb2.StageOutput]:
        reader = asyncio.create_task(self._read(inputs), name="generate-reader")
        try:
            while True:
                item = await self._out.get()
                if item is _END:
                    break
                assert isinstance(item, stage_pb2.StageOutput)
                yield item
            await reader
        finally:
            # Client gone (or stream done): nothing it started may keep running.
            reader.cancel()
            for request_id in list(self._mine):
                self._runtime.cancel(request_id, "")
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, inputs: AsyncIterator[stage_pb2.StageInput]) -> None:
        try:
            async for message in inputs:
                kind = message.WhichOneof("kind")
                if kind == "submit":
                    await self._submit(message.submit)
                elif kind == "chunk":
                    try:
                        self._chunks.add(message.chunk)
                    except OmniError as exc:
                        await self._reject("", exc)
                elif kind == "cancel":
                    request_id = message.cancel.request_id
                    if request_id in self._mine:
                        self._runtime.cancel(request_id)
                    elif self._assembler.discard(request_id):
                        await self._emit(ErrorOut(request_id, _cancelled(request_id)))
                else:
                    await self._reject("", InvalidArgument("input: expected submit or cancel"))
        finally:
            self._reading = False
            for feed in self._feeds.values():
                await feed.close()  # the client stopped sending: what came is all there is
            self._feeds.clear()
            await self._maybe_end()

    async def _submit(self, submit: stage_pb2.Submit) -> None:
        runtime = self._runtime
        request_id = submit.request_id
        try:
            convert.check_request_id(request_id, "submit.request_id")
            convert.check_size(submit, runtime.config.runtime.max_message_bytes)
            self._chunks.resolve(submit.inputs.tensors, "inputs.tensors")
            if request_id not in self._mine and request_id not in self._consumers:
                has = submit.HasField("consumer")
                self._consumers[request_id] = submit.consumer if has else None
            if runtime.config.runtime.streaming_input and (
                request_id in self._feeds or not submit.is_last
            ):
                await self._window(submit)
                return
            whole = self._assembler.add(submit, in_flight=request_id in self._mine)
            if whole is None:
                return  # more windows of this request's input are coming
            runtime.admit(self._convert(whole), self._emit)
            self._mine.add(request_id)
        except OmniError as exc:
            if request_id not in self._mine:
                self._consumers.pop(request_id, None)
            await self._reject(request_id, exc)

    def _convert(self, submit: stage_pb2.Submit) -> EngineRequest:
        apply_transform(submit)
        runtime = self._runtime
        return convert.engine_request(
            submit, runtime.engine.supported_params, runtime.config.engine, self._tensors.receiver
        )

    async def _window(self, submit: stage_pb2.Submit) -> None:
        """streaming_input: each window goes to the engine as it arrives."""
        rid = submit.request_id
        feed = self._feeds.get(rid)
        if feed is None:
            if rid in self._mine or submit.sequence != 0:
                raise InvalidArgument(
                    f"submit.sequence: request {rid!r} expected 0, got {submit.sequence}"
                    if rid not in self._mine
                    else f"submit.request_id: {rid!r} is already in flight",
                    field="submit.request_id" if rid in self._mine else "submit.sequence",
                )
            feed = _Feed()
            self._runtime.admit(self._convert(submit), self._emit, more=feed.windows())
            self._mine.add(rid)
            self._feeds[rid] = feed
        else:
            try:
                if submit.sequence != feed.next_sequence:
                    raise InvalidArgument(
                        f"submit.sequence: request {rid!r} expected {feed.next_sequence}, "
                        f"got {submit.sequence}",
                        field="submit.sequence",
                    )
                if _has_input(submit.inputs):  # an empty last window only ends the input
                    await feed.put(self._runtime.prepare(self._convert(submit)))
            except OmniError as exc:
                # A bad window ends its request with that error; the stream goes on.
                del self._feeds[rid]
                self._runtime.cancel(rid, exc.message, exc)
                return
        feed.next_sequence += 1
        if submit.is_last:
            await feed.close()
            del self._feeds[rid]

    async def _reject(self, request_id: str, error: OmniError) -> None:
        stage = self._runtime.config.name
        logger.info("stage %s: refused request %r: %s", stage, request_id, error.message)
        await self._out.put(convert.error_output(request_id, error))

    async def _emit(self, event: StageEvent) -> None:
        rid = event.request_id
        consumer = self._consumers.get(rid)

        def encode(tensor: torch.Tensor, name: str) -> tensor_pb2.Tensor:
            return self._tensors.encode(tensor, name, rid, consumer)

        if isinstance(event, SegmentOut) and event.segment.tensors:
            # Copying tensors into shared blocks or bytes takes milliseconds per
            # megabyte: off the loop, so other requests' events keep flowing.
            output = await asyncio.to_thread(convert.to_output, event, encode)
        else:
            output = convert.to_output(event, encode)
        if output.WhichOneof("kind") == "segment":
            # Bytes too large for one message travel first, as chunks of the stream.
            threshold = self._runtime.config.runtime.chunk_bytes
            for chunk in chunks.split(output.segment.tensors, threshold=threshold):
                await self._out.put(stage_pb2.StageOutput(chunk=chunk))
        await self._out.put(output)
        if isinstance(event, CompletedOut | ErrorOut):
            self._consumers.pop(rid, None)
            self._mine.discard(event.request_id)
            self._feeds.pop(event.request_id, None)  # later windows of it are refused
            await self._maybe_end()

    async def _maybe_end(self) -> None:
        if self._ended or self._reading or self._mine:
            return
        self._ended = True
        await self._out.put(_END)


class _Feed:
    """The input windows of one streaming request, bounded so a client that
    sends faster than the engine consumes is held back by flow control."""

    def __init__(self, depth: int = 4) -> None:
        self._queue: asyncio.Queue[EngineRequest | None] = asyncio.Queue(depth)
        self.next_sequence = 0

    async def put(self, request: EngineRequest) -> None:
        await self._queue.put(request)

    async def close(self) -> None:
        await self._queue.put(None)

    async def windows(self) -> AsyncIterator[EngineRequest]:
        while (request := await self._queue.get()) is not None:
            yield request


def _has_input(inputs: stage_pb2.StageInputs) -> bool:
    return bool(inputs.text or inputs.messages or inputs.token_ids or inputs.tensors)


def _cancelled(request_id: str) -> OmniError:
    return Cancelled(f"request {request_id}: cancelled by the client")
