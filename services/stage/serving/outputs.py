"""The output side of one Generate stream: runtime events become wire outputs.

``StreamEmitter`` is the one place a request's events turn into ``StageOutput``
messages (Segment, Progress, Completed, Error): output tensors go by the
transport ``tensor_io`` picks for their consumer, and bytes too large for one
message go first, as chunks of the stream. Outputs wait in a bounded queue, so a
client that stops reading holds its requests' producers; a request under credit
(``Submit.credit``) waits for its own Credit before each Segment or Progress.

The stream ends once its client has half-closed and every request it started
has reported its final event. It remembers the ids whose final event it sent
(the last ``ENDED_KEPT``), so that a Cancel that crossed one on the wire is
known for what it is and answered with nothing: every request id gets exactly
one final event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import torch

from services.engines.base import AudioFormat
from services.mesh.data.chunk_wire import EncodedChunk
from services.mesh.errors import OmniError, wire_error
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.tensors import codec
from services.stage.serving import events, observe
from services.stage.serving.requests import RequestRecord
from services.stage.serving.runtime import StageRuntime
from services.stage.serving.tensor_io import StageTensors

logger = logging.getLogger(__name__)

_END = object()
ENDED_KEPT = 1024  # ids whose final event a stream remembers sending

Encode = Callable[[torch.Tensor, str], tensor_pb2.Tensor]


class StreamEmitter:
    """What one Generate stream sends, in order; the ``Emitter`` its requests emit to."""

    def __init__(self, runtime: StageRuntime, tensors: StageTensors) -> None:
        config = runtime.config
        self._stage = config.name
        self._chunk_bytes = config.runtime.chunk_bytes
        self._requests = runtime.requests
        self._tensors = tensors
        self._queue: asyncio.Queue[object] = asyncio.Queue(config.runtime.output_queue_size)
        self._input_open = True
        self._ended = False
        self._finished: dict[str, None] = {}  # ids whose final event went, oldest first

    async def outputs(self) -> AsyncIterator[stage_pb2.StageOutput | EncodedChunk]:
        """Everything the stream sends, until it ends."""
        while (item := await self._queue.get()) is not _END:
            assert isinstance(item, stage_pb2.StageOutput | EncodedChunk)
            yield item

    def finished(self, request_id: str) -> bool:
        """Whether this stream sent ``request_id`` its final event (of late)."""
        return request_id in self._finished

    def _finish(self, request_id: str) -> None:
        if not request_id:
            return
        self._finished.pop(request_id, None)
        self._finished[request_id] = None
        if len(self._finished) > ENDED_KEPT:
            del self._finished[next(iter(self._finished))]

    async def emit(self, record: RequestRecord, event: events.StageEvent) -> None:
        if isinstance(event, events.CompletedOut | events.ErrorOut):
            self._finish(record.request_id)  # before any wait: a Cancel may cross it
        if record.credit is not None and isinstance(event, events.SegmentOut | events.ProgressOut):
            await record.credit.spend()  # out of credit: the request pauses here
        rid, consumer = record.request_id, record.consumer

        def encode(tensor: torch.Tensor, name: str) -> tensor_pb2.Tensor:
            began = time.time_ns()
            msg = self._tensors.encode(tensor, name, rid, consumer)
            observe.handed_off(self._stage, msg, began)
            return msg

        if isinstance(event, events.SegmentOut) and event.segment.tensors:
            # Copying tensors into shared blocks or bytes takes milliseconds per
            # megabyte: off the loop, so other requests' events keep flowing.
            output = await asyncio.to_thread(to_output, event, encode)
        else:
            output = to_output(event, encode)
        if output.WhichOneof("kind") == "segment":
            # Bytes too large for one message travel first, as chunks of the stream.
            for chunk in self._tensors.chunk_outputs(output.segment, self._chunk_bytes):
                await self._queue.put(chunk)
        await self._queue.put(output)
        if isinstance(event, events.CompletedOut | events.ErrorOut):
            await self._maybe_end()

    async def refuse(self, request_id: str, error: OmniError) -> None:
        """An Error for a request that is not in flight here (or for no request)."""
        logger.info("stage %s: refused request %r: %s", self._stage, request_id, error.message)
        self._finish(request_id)
        await self._queue.put(error_output(request_id, error))

    async def input_closed(self) -> None:
        """The client sends no more: the stream ends once its requests have."""
        self._input_open = False
        await self._maybe_end()

    async def end_now(self) -> None:
        """The RPC itself fails: nothing more is sent."""
        self._ended = True
        await self._queue.put(_END)

    async def _maybe_end(self) -> None:
        if self._ended or self._input_open:
            return
        if any(not r.final for r in self._requests.of_stream(self)):
            return
        self._ended = True
        await self._queue.put(_END)


def error_output(request_id: str, error: OmniError) -> stage_pb2.StageOutput:
    return stage_pb2.StageOutput(error=wire_error(request_id, error))


def to_output(event: events.StageEvent, encode: Encode = codec.to_proto) -> stage_pb2.StageOutput:
    """The wire form of ``event``; ``encode`` picks each output tensor's transport."""
    if isinstance(event, events.SegmentOut):
        seg = event.segment
        return stage_pb2.StageOutput(
            segment=stage_pb2.Segment(
                request_id=event.request_id,
                sequence=seg.sequence,
                is_last=seg.is_last,
                token_ids=seg.token_ids,
                text_delta=seg.text,
                tensors=[encode(t, name) for name, t in seg.tensors.items()],
                blobs=[
                    tensor_pb2.Blob(name=b.name, media_type=b.media_type, data=b.data)
                    for b in seg.blobs
                ],
                audio_format=_audio_format(seg.audio_format),
            )
        )
    if isinstance(event, events.ProgressOut):
        p = event.progress
        out = stage_pb2.Progress(
            request_id=event.request_id, step=p.step, total_steps=p.total_steps
        )
        if p.preview is not None:
            out.preview.CopyFrom(codec.to_proto(p.preview, "preview"))
        return stage_pb2.StageOutput(progress=out)
    if isinstance(event, events.CompletedOut):
        return stage_pb2.StageOutput(
            completed=stage_pb2.Completed(
                request_id=event.request_id,
                finish_reason=event.finish_reason,
                usage=stage_pb2.Usage(
                    prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                ),
                timings=stage_pb2.Timings(
                    queue_ms=event.queue_ms,
                    time_to_first_ms=event.time_to_first_ms,
                    total_ms=event.total_ms,
                ),
            )
        )
    return error_output(event.request_id, event.error)


def _audio_format(audio: AudioFormat | None) -> stage_pb2.AudioFormat | None:
    if audio is None:
        return None
    return stage_pb2.AudioFormat(sample_rate=audio.sample_rate, channels=audio.channels)
