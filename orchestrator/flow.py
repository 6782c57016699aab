"""One request's journey through the pipeline's stages.

Every stage the request reaches gets its own Generate stream (multiplexed on the
stage's one channel): cancelling the flow cancels those streams, and the stages
then drop the request, queued or running. Each edge keeps the request's window
state; windows go to the consuming stage as soon as they are complete. Above an
edge's high watermark the flow stops reading the upstream stream until the
downstream has taken it back under the low one: HTTP/2 flow control then holds
the upstream stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc

from orchestrator.lanes import Lane
from orchestrator.pipeline import Edge, PipelineConfig
from orchestrator.sink import EventSink
from services.mesh.errors import OmniError, Unavailable
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.stage_client import StageClient

logger = logging.getLogger(__name__)


class StageFailed(OmniError):
    """A stage ended the request with an error, or the stage itself went away."""

    def __init__(self, stage: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.stage = stage


class RequestFlow:
    def __init__(
        self,
        request_id: str,
        pipeline: PipelineConfig,
        clients: Mapping[str, StageClient],
        sink: EventSink,
        entry_inputs: AsyncIterator[stage_pb2.Submit],
        stage_params: Mapping[str, stage_pb2.GenerationParams],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.request_id = request_id
        self._pipeline = pipeline
        self._clients = clients
        self._sink = sink
        self._entry_inputs = entry_inputs
        self._params = stage_params
        self._clock = clock
        self._outputs = frozenset(pipeline.outputs)
        self._lanes: dict[str, Lane] = {}  # by downstream stage
        self.active_stages: set[str] = set()
        self.blocked_s: dict[str, float] = {}

    async def run(self) -> orchestrator_pb2.Done:
        """Drive the request to its end; never raises except on cancellation."""
        began = self._clock()
        done = orchestrator_pb2.Done(request_id=self.request_id, code_name="OK")
        try:
            async with asyncio.TaskGroup() as tasks:
                for stage in self._pipeline.order:
                    tasks.create_task(self._stage(stage), name=f"{self.request_id}@{stage}")
        except* StageFailed as group:
            first = group.exceptions[0]
            assert isinstance(first, StageFailed)
            done.code, done.code_name = first.code.value[0], first.code.name
            done.message, done.stage = first.message, first.stage
        done.total_ms = (self._clock() - began) * 1e3
        for name, lane in self._lanes.items():
            self.blocked_s[f"{lane.edge.from_}->{name}"] = lane.blocked_s
        return done

    def _lane(self, edge: Edge) -> Lane:
        lane = self._lanes.get(edge.to)
        if lane is None:
            lane = self._lanes[edge.to] = Lane(edge, self._clock)
        return lane

    async def _inputs(self, stage: str) -> AsyncIterator[stage_pb2.Submit]:
        # A stage whose consumers condition on its hidden states must emit them.
        hidden = any(
            e.transform == "hidden_states_to_prompt_embeds" for e in self._pipeline.children(stage)
        )
        async for submit in self._submits(stage):
            if hidden:
                submit.params.return_hidden_states = True
            yield submit

    async def _submits(self, stage: str) -> AsyncIterator[stage_pb2.Submit]:
        if stage == self._pipeline.entry:
            async for submit in self._entry_inputs:
                yield submit
            return
        edge = self._pipeline.incoming(stage)
        assert edge is not None
        lane = self._lane(edge)
        params = self._params.get(stage)
        while (window := await lane.take()) is not None:
            submit = stage_pb2.Submit(
                request_id=self.request_id,
                sequence=window.sequence,
                is_last=window.is_last,
                transform=edge.transform or "",
            )
            submit.inputs.text = window.text
            submit.inputs.token_ids.extend(window.token_ids)
            submit.inputs.tensors.extend(window.tensors)
            if params is not None:
                submit.params.CopyFrom(params)
            yield submit
            lane.taken(window)

    async def _stage(self, stage: str) -> None:
        client = self._clients[stage]
        call = client.open_stream()
        self.active_stages.add(stage)
        writer = asyncio.create_task(self._write(stage, call))
        try:
            await self._read(stage, call)
            await writer
        except grpc.aio.AioRpcError as exc:
            raise StageFailed(
                stage,
                exc.code()
                if exc.code() != grpc.StatusCode.CANCELLED
                else grpc.StatusCode.UNAVAILABLE,
                f"stage {stage} at {client.address} failed: {exc.code().name}: {exc.details()}",
            ) from None
        finally:
            writer.cancel()
            call.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            self.active_stages.discard(stage)

    async def _write(self, stage: str, call: grpc.aio.StreamStreamCall) -> None:
        async for submit in self._inputs(stage):
            await call.write(stage_pb2.StageInput(submit=submit))
        await call.done_writing()

    async def _read(self, stage: str, call: grpc.aio.StreamStreamCall) -> None:
        lanes = [self._lane(edge) for edge in self._pipeline.children(stage)]
        is_output = stage in self._outputs
        while (output := await call.read()) is not grpc.aio.EOF:
            kind = output.WhichOneof("kind")
            if kind == "error":
                error = output.error
                code = _status(error.code)
                raise StageFailed(stage, code, f"stage {stage}: {error.code_name}: {error.message}")
            if is_output:
                await self._sink.put(_event(stage, output))
            if kind == "segment":
                for lane in lanes:
                    await lane.put(lane.windows.add(output.segment))
            elif kind == "completed":
                for lane in lanes:
                    await lane.put(lane.windows.finish())
                    lane.close()
                return
        raise StageFailed(
            stage, grpc.StatusCode.UNAVAILABLE, f"stage {stage} ended its stream before completing"
        )


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


def _event(stage: str, output: stage_pb2.StageOutput) -> orchestrator_pb2.GenerateEvent:
    event = orchestrator_pb2.GenerateEvent(stage=stage)
    kind = output.WhichOneof("kind")
    getattr(event, kind).CopyFrom(getattr(output, kind))
    return event


def not_ready(stage: str, reason: str) -> Unavailable:
    return Unavailable(f"stage {stage} is not ready: {reason}")
