"""One request's journey through the pipeline's stages.

The request shares each stage's long-lived Generate stream with the others
(``stage_mux``): stopping the flow sends the stage a Cancel for it, and the
stage drops it, queued or running. Each edge keeps the request's window state;
windows go to the consuming stage as soon as they are complete. Above an edge's
high watermark (or while its client reads slowly) the flow stops taking the
upstream's outputs until the downstream has taken it back under the low one:
its credit runs out and the upstream stage pauses this request alone. The
client's deadline is the flow's: when it passes, the stages still working are
cancelled and the request ends DEADLINE_EXCEEDED (the stages are told the time
left on each first Submit too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc

from orchestrator.server.pipeline import Edge
from orchestrator.server.requests import observe
from orchestrator.server.requests.audio_clock import AudioClock
from orchestrator.server.requests.client_event import client_event
from orchestrator.server.requests.errors import StageFailed, StreamBroken, first_failure
from orchestrator.server.requests.lanes import Lane
from orchestrator.server.requests.request_stream import RequestStream
from orchestrator.server.requests.sink import EventSink
from orchestrator.server.requests.stage_mux import StageStreams
from orchestrator.server.requests.submits import StageSubmits, from_window
from orchestrator.server.requests.topology import Topology, transform_needs
from orchestrator.server.requests.windows import Window
from services.mesh import errors
from services.mesh.data import chunks, media_wire
from services.mesh.data.chunk_wire import STAGE_INPUT_CHUNK
from services.mesh.data.ref_reader import REFS, RefReader
from services.mesh.errors import DeadlineExceeded, OmniError
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.rpc.stage_client import StageClient

logger = logging.getLogger(__name__)

# What each stage said of itself (its Describe), once it is up; None = not yet.
Describe = Callable[[str], stage_pb2.StageDescription | None]
# A Submit on its way to a stage, with the edge's window it carries (None: the client's).
Sent = tuple[stage_pb2.Submit, Window | None]
# What a producer is asked for when its consumer's transform needs it.
_ASK_FOR = {"hidden_states": "return_hidden_states"}


class RequestFlow:
    def __init__(
        self,
        request_id: str,
        topology: Topology,
        clients: Mapping[str, StageClient],
        streams: StageStreams,
        sink: EventSink,
        entry_inputs: AsyncIterator[stage_pb2.Submit],
        stage_params: Mapping[str, stage_pb2.GenerationParams],
        clock: Callable[[], float] = time.monotonic,
        *,
        stage_id: str = "",
        describe: Describe = lambda _stage: None,
        refs: RefReader | None = None,
        chunk_bytes: int = chunks.CHUNK_BYTES,
        deadline: float | None = None,
        affinity: str = "",
    ) -> None:
        self.request_id = request_id  # the client's: in every event it gets
        # What the stages know the request by: unique in the mesh (the router's making).
        self.stage_id = stage_id or request_id
        self.deadline = deadline  # time.monotonic() by which the client wants its answer
        self._affinity = affinity  # its conversation's key ("": none)
        self.topology = topology  # the pipeline's, or one stage's alone
        self._clients = clients
        self._streams = streams
        self._sink = sink
        self._entry_inputs = entry_inputs
        self._params = stage_params
        self._clock = clock
        self._outputs = topology.outputs
        self._lanes: dict[str, Lane] = {}  # by downstream stage
        self._describe = describe
        self._chunk_bytes = chunk_bytes
        self._refs = refs
        self._client_hidden: dict[str, bool] = {}  # did the client itself ask for them?
        self._may_share: set[str] = set()  # stages told who consumes: they may use shm
        self._refs_from: set[str] = set()  # stages whose segments carried shared refs
        self.active_stages: set[str] = set()
        self._completed: set[str] = set()  # stages that gave their Completed
        self.blocked_s: dict[str, float] = {}
        self.bytes_in: dict[str, int] = {}  # wire bytes read from each stage
        self.audio = AudioClock(clock)  # the audio the client hears, as it would play
        self._served_by: dict[str, StageClient] = {}  # the replica of each stage it ran on

    async def run(self) -> orchestrator_pb2.Done:
        """Drive the request to its end; never raises except on cancellation."""
        began = self._clock()
        done = errors.done(self.request_id)
        left = None if self.deadline is None else self.deadline - time.monotonic()
        try:
            async with asyncio.timeout(left):
                async with asyncio.TaskGroup() as tasks:
                    entry, *rest = self.topology.order
                    for stage in rest:
                        tasks.create_task(self._stage(stage), name=f"{self.stage_id}@{stage}")
                    # The entry stage in this task: one task fewer per request. Its
                    # failure joins the group as a task's would (the others are cancelled).
                    await self._stage(entry)
        except BaseExceptionGroup as group:  # the group itself, not a split of it
            first = first_failure(group)
            done = errors.done(self.request_id, first, first.stage)
        except TimeoutError:
            done = self._expired()
        done.total_ms = (self._clock() - began) * 1e3
        for name, lane in self._lanes.items():
            self.blocked_s[f"{lane.edge.from_}->{name}"] = lane.blocked_s
        return done

    @property
    def shared_from(self) -> set[str]:
        """Stages that may still hold shared blocks for this request: those that
        sent refs, and those that did not finish (refs may have been on their way)."""
        return {s for s in self._may_share if s in self._refs_from or s not in self._completed}

    def _expired(self) -> orchestrator_pb2.Done:
        """The client's deadline passed: named after the first stage still working."""
        working = [s for s in self.topology.order if s not in self._completed] or [
            self.topology.order[-1]
        ]
        error = DeadlineExceeded(
            f"request {self.request_id}: the deadline passed while stage {working[0]} was working"
        )
        return errors.done(self.request_id, error, working[0])

    def _lane(self, edge: Edge) -> Lane:
        lane = self._lanes.get(edge.to)
        if lane is None:
            lane = self._lanes[edge.to] = Lane(edge, self._clock)
        return lane

    def _stage_submits(self, stage: str) -> StageSubmits:
        # What the consumers' transforms need, the producer is asked to emit.
        children = self.topology.children[stage]
        asks = {
            _ASK_FOR[name]
            for e in children
            for name in transform_needs(self._describe(e.to), e.transform) or ()
            if name in _ASK_FOR
        }
        # One consumer on this node that can open shared blocks: tensors go by ref.
        described = self._describe(children[0].to) if len(children) == 1 else None
        consumer = described.node if described is not None else None
        return StageSubmits(self.stage_id, frozenset(asks), consumer, self.deadline)

    def _outgoing(
        self, stage: str, submits: StageSubmits, submit: stage_pb2.Submit
    ) -> stage_pb2.Submit:
        self._client_hidden.setdefault(stage, submit.params.return_hidden_states)
        if submits.consumer is not None:
            self._may_share.add(stage)
        return submits.outgoing(submit)

    async def _inputs(self, stage: str, submits: StageSubmits) -> AsyncIterator[Sent]:
        """The stage's Submits, completed for the wire, each with the window it
        carries (None: the client's own). Nothing is held open across a yield: the
        first is taken in the stage's task and the rest may be in a writer task."""
        if stage == self.topology.entry:
            async for submit in self._entry_inputs:
                yield self._outgoing(stage, submits, submit), None
            return
        edge = self.topology.incoming[stage]
        assert edge is not None
        lane = self._lane(edge)
        params = self._params.get(stage)
        while (window := await lane.take()) is not None:
            submit = from_window(self.stage_id, window, edge.transform or "", params)
            yield self._outgoing(stage, submits, submit), window

    async def _stage(self, stage: str) -> None:
        with observe.stage_span(self.stage_id, stage):
            await self._run_stage(stage)

    async def _run_stage(self, stage: str) -> None:
        channel = await self._streams.join(stage, self.stage_id, self._affinity)
        self.active_stages.add(stage)
        writer: asyncio.Task[None] | None = None
        try:
            # The stage says nothing of the request before its first Submit, sent
            # here; only more input to come (a GenerateStream, a windowed edge) needs
            # a writer task beside the reading: most requests make none.
            submits = self._stage_submits(stage)
            inputs = self._inputs(stage, submits)
            if await self._send_first(stage, channel, inputs):
                await anext(inputs, None)  # the input's end
            else:
                writer = asyncio.create_task(self._write(channel, submits, stage, inputs))
            await self._read(stage, channel)
            if writer is not None:
                await writer
        except StageFailed:
            raise
        except StreamBroken as exc:  # its details name the replica
            raise StageFailed(
                stage, exc.code, f"stage {stage} failed: {exc.code.name}: {exc.details}"
            ) from None
        except OmniError as exc:  # what the stage sent could not be routed (chunks, windows)
            raise StageFailed(stage, exc.code, f"stage {stage}: {exc.message}", exc.field) from None
        finally:
            self._served_by[stage] = channel.replica.client  # it holds the shared blocks
            channel.close()
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            self.active_stages.discard(stage)

    async def _send_first(
        self, stage: str, channel: RequestStream, inputs: AsyncIterator[Sent]
    ) -> bool:
        """Send the stage's first Submit, if any; True if it was the last. It is not
        held once sent: the stage's task must not keep tens of MB of input alive."""
        first = await anext(inputs, None)
        return first is not None and await self._send(stage, channel, *first)

    async def _send(
        self, stage: str, channel: RequestStream, submit: stage_pb2.Submit, window: Window | None
    ) -> bool:
        """Send one Submit (a window's in its span, then handed back to its lane);
        True if it was the last."""
        if window is None:
            return await self._put(channel, submit)
        lane = self._lanes[stage]
        with observe.window_span(f"{lane.edge.from_}->{stage}", submit):
            last = await self._put(channel, submit)
        lane.taken(window)
        return last

    async def _put(self, channel: RequestStream, submit: stage_pb2.Submit) -> bool:
        """``submit`` on the stream, large tensors and media first as chunks. A last one, whole,
        is posted, not waited for: only a Credit or Cancel follows it, in order, and
        a failed write breaks the stream, which reading reports. Any other is waited
        for: the edge's watermark counts it until it is written."""
        frames = [
            *chunks.split_encoded(
                submit.inputs.tensors, [], STAGE_INPUT_CHUNK, threshold=self._chunk_bytes
            ),
            *media_wire.split_encoded(
                submit.inputs, STAGE_INPUT_CHUNK, threshold=self._chunk_bytes
            ),
        ]
        for frame in frames:
            await channel.write(frame)
        message = stage_pb2.StageInput(submit=submit)
        if submit.is_last and not frames:
            channel.post(message)
        else:
            await channel.write(message)
        return submit.is_last

    async def _write(
        self, channel: RequestStream, submits: StageSubmits, stage: str, inputs: AsyncIterator[Sent]
    ) -> None:
        """The Submits after the first, as they come."""
        ended = False
        async for submit, window in inputs:
            ended = await self._send(stage, channel, submit, window)
            del submit, window  # sent: not held while the next one is awaited
        if submits.sent and not ended:  # the client stopped before its last window
            await channel.write(stage_pb2.StageInput(submit=submits.input_ended()))

    async def _read(self, stage: str, channel: RequestStream) -> None:
        lanes = [self._lane(edge) for edge in self.topology.children[stage]]
        is_output = stage in self._outputs
        while True:
            output = await channel.read()
            self.bytes_in[stage] = self.bytes_in.get(stage, 0) + output.ByteSize()
            observe.outputs(stage, output)
            kind = output.WhichOneof("kind")
            if kind == "error":
                error = output.error
                code = errors.status_code(error.code)
                # The stage's words name the request by its stage id: the client's own here.
                said = error.message.replace(self.stage_id, self.request_id)
                message = f"stage {stage}: {error.code_name}: {said}"
                raise StageFailed(stage, code, message, error.field)
            if kind == "segment" and stage in self._may_share:
                if any(t.WhichOneof("data") in REFS for t in output.segment.tensors):
                    self._refs_from.add(stage)
            if is_output:
                await self._to_client(stage, output)
            if kind == "segment":
                for lane in lanes:
                    await lane.put(lane.windows.add(output.segment))
            elif kind == "completed":
                self._completed.add(stage)
                for lane in lanes:
                    await lane.put(lane.windows.finish())
                    lane.close()
                return
            channel.taken(output)  # handed on: the stage may send another

    async def _to_client(self, stage: str, output: stage_pb2.StageOutput) -> None:
        hidden = self._client_hidden.get(stage, False)
        event = client_event(stage, output, self.request_id, hidden=hidden)
        if event.WhichOneof("kind") == "segment":
            tensors = event.segment.tensors
            self.audio.segment(stage, event.segment)
            for index, tensor in enumerate(tensors):
                if tensor.WhichOneof("data") in REFS and self._refs:
                    # Clients get bytes: a ref names memory of a mesh process (a
                    # pull waits on the network: off the event loop).
                    where = f"segment.tensors[{index}]"
                    read = self._refs.read
                    data = await asyncio.to_thread(read, tensor, where, self.stage_id)
                    tensors[index].CopyFrom(data)
            blobs = event.segment.blobs
            for chunk in [
                *chunks.split(tensors, threshold=self._chunk_bytes),
                *chunks.split_blobs(blobs, threshold=self._chunk_bytes),
            ]:
                await self._sink.put(orchestrator_pb2.GenerateEvent(stage=stage, chunk=chunk))
        await self._sink.put(event)

    async def release_shared(self) -> None:
        """Tell the stages that handed over shared blocks that the request is over."""
        request = stage_pb2.ReleaseTensorsRequest(request_id=self.stage_id)

        async def release(stage: str) -> None:
            try:
                client = self._served_by.get(stage, self._clients[stage])
                await client.release_tensors(request, timeout_s=5.0)
            except grpc.aio.AioRpcError as exc:  # its TTL frees them
                logger.info(
                    "request %s: release on stage %s failed: %s",
                    self.stage_id,
                    stage,
                    exc.code().name,
                )

        await asyncio.gather(*(release(stage) for stage in self.shared_from))
