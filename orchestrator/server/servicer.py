"""The Orchestrator gRPC service's methods: thin adapters from the wire to the
router (requests) and the stage monitors (stages), both owned by
``OrchestratorServer`` (orchestrator/server/server.py). A request refused before it
reaches the router gets its one Done here (``client_input.refusal``). Generate
ends its RPC with the request's status after the Done (``errors.end_with``);
GenerateStream carries several requests, so it ends OK. Abort, PauseGeneration
and ResumeGeneration also reach the other orchestrators over the same stages
(``orchestrator.server.peers``), so a call does the same whichever one it lands on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from orchestrator.server.peers import forwarded_by, passed_on
from orchestrator.server.requests.client_input import (
    check_abort_ids,
    check_alone,
    check_stage_params,
    refusal,
    refuse_refs,
    single,
    stream_requests,
)
from orchestrator.server.requests.sink import EventSink
from orchestrator.server.requests.submits import from_client
from orchestrator.server.stages.monitor import StageMonitor
from services.mesh.errors import OmniError, Unavailable, abort_rpc, end_with, status_code
from services.mesh.pb.omni.v1 import orchestrator_pb2, orchestrator_pb2_grpc, stage_pb2
from services.mesh.rpc.request_ids import check_request_id
from services.mesh.security import Principal

if TYPE_CHECKING:
    from orchestrator.server.server import OrchestratorServer

logger = logging.getLogger(__name__)


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, server: OrchestratorServer) -> None:
        self._server = server
        self._router = server.router
        self._auth = server.authenticator
        self._peers = server.peers

    def _caller(self, context: grpc.aio.ServicerContext) -> Principal:
        principal = self._auth.principal(context)
        assert principal is not None, "the AuthInterceptor lets only known callers in"
        return principal

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
        rid = request.request_id or uuid.uuid4().hex
        sink = EventSink(*self._server.client_watermarks)
        caller = self._caller(context)
        try:
            check_request_id(rid, "request_id")
            check_stage_params(request.stage_params, self._server.monitors, "stage_params")
            check_alone(request, self._server.monitors)
            refuse_refs(request.inputs)
            self._router.refuse_kinds(request.inputs, alone=request.stage)
            self._router.start(
                rid,
                single(from_client(rid, request)),
                dict(request.stage_params),
                sink,
                owner=caller,
                timeout_s=context.time_remaining(),
                alone=request.stage,
                affinity=request.affinity_key,
                outputs=request.outputs,
            )
        except OmniError as exc:
            if self._going_away(exc.code):
                await abort_rpc(context, exc)
            logger.info("request %s refused: %s", rid, exc.message)
            refused = refusal(rid, exc)
            yield refused
            end_with(context, refused.done)
            return
        # Its Submit carries the inputs now, and goes once sent: the request must
        # not hold a copy of them (tens of MB, perhaps) for as long as it runs.
        del request
        finished = sent = False
        try:
            while (event := await sink.get()) is not None:
                if event.WhichOneof("kind") == "done":
                    finished = True
                    if not sent and self._going_away(status_code(event.done.code)):
                        await abort_rpc(context, Unavailable(event.done.message))
                    yield event
                    end_with(context, event.done)
                    return
                yield event
                sent = True
        finally:
            if not finished:
                self._router.cancel_silently(rid, caller)

    def _going_away(self, code: grpc.StatusCode) -> bool:
        """A request this orchestrator ends UNAVAILABLE because it is stopping, before
        anything of it went out: the RPC ends UNAVAILABLE alone, the server going
        away (no Done), so a client tries it on another orchestrator
        (orchestrator/client/targets.py)."""
        return self._router.stopping and code == grpc.StatusCode.UNAVAILABLE

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[orchestrator_pb2.StreamInput],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
        server = self._server
        async for event in stream_requests(
            self._router,
            request_iterator,
            list(server.monitors),
            server.client_watermarks,
            server.max_input_bytes,
            owner=self._caller(context),
            timeout_s=context.time_remaining(),
            budget=server.input_budget,
        ):
            yield event

    async def Abort(
        self, request: stage_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.AbortResponse:
        # Checked before anything is echoed back: the reply is as small as the ids may be.
        try:
            check_abort_ids(request.request_ids)
        except OmniError as exc:
            await abort_rpc(context, exc)
        ids = list(request.request_ids)
        metadata = context.invocation_metadata()
        if self._peers.is_self(metadata):  # passed on by this very process: done here already
            return stage_pb2.AbortResponse(not_found=ids)
        # Another client's request is reported not found, as if it did not exist.
        aborted, not_found = self._router.abort(ids, self._caller(context))
        if not_found and forwarded_by(metadata) is None:  # held by another orchestrator?
            found = set(await self._peers.abort(not_found, passed_on(metadata)))
            aborted += [rid for rid in not_found if rid in found]
            not_found = [rid for rid in not_found if rid not in found]
        return stage_pb2.AbortResponse(aborted=aborted, not_found=not_found)

    async def ListStages(
        self, request: orchestrator_pb2.ListStagesRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListStagesResponse:
        return orchestrator_pb2.ListStagesResponse(
            stages=[self._described(m.status) for m in self._server.monitors.values()],
            pipeline=self._server.pipeline.name,
        )

    def _described(self, status: orchestrator_pb2.StageStatus) -> orchestrator_pb2.StageStatus:
        """``status`` with what the stage's Describe said of it, once it has answered."""
        described = orchestrator_pb2.StageStatus()
        described.CopyFrom(status)
        described.output = status.name in self._server.pipeline.outputs
        description = self._server.descriptions.get(status.name)
        if description is None:
            return described
        described.engine = description.engine
        described.output_tensors.extend(description.output_tensors)
        described.accepts.extend(description.accepts)
        described.voices.extend(description.voices)
        described.compute = description.compute
        return described

    async def WatchStages(
        self, request: orchestrator_pb2.WatchStagesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.StageStatus]:
        merged: asyncio.Queue[orchestrator_pb2.StageStatus] = asyncio.Queue()

        async def follow(monitor: StageMonitor) -> None:
            async for status in monitor.changes():
                await merged.put(self._described(status))

        tasks = [asyncio.create_task(follow(m)) for m in self._server.monitors.values()]
        try:
            while True:
                yield await merged.get()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def PauseGeneration(
        self, request: orchestrator_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.PauseGenerationResponse:
        metadata = context.invocation_metadata()
        if not self._peers.is_self(metadata):
            self._router.generation.pause()
            if forwarded_by(metadata) is None:  # every orchestrator holds its own new requests
                await self._peers.pause(passed_on(metadata))
        return orchestrator_pb2.PauseGenerationResponse(paused=True)

    async def ResumeGeneration(
        self, request: orchestrator_pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ResumeGenerationResponse:
        metadata = context.invocation_metadata()
        if not self._peers.is_self(metadata):
            self._router.generation.resume()
            if forwarded_by(metadata) is None:
                await self._peers.resume(passed_on(metadata))
        return orchestrator_pb2.ResumeGenerationResponse(paused=False)
