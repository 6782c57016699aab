"""Python clients of the Orchestrator service: ``AsyncClient`` and ``Client``.

async with AsyncClient("127.0.0.1:50050") as client:
    result = await client.generate("What is the capital of France?").collect()

with Client("127.0.0.1:50050") as client:
    for event in client.generate("Hello"):
        ...

Several orchestrators: ``AsyncClient("10.0.0.5:50050,10.0.0.6:50050")`` or
``AsyncClient("dns:omni-orchestrator-peers:50050")`` deals calls between them and
tries a call that had no answer again on another (orchestrator/client/targets.py).

A failed request ends its Generate RPC with the failure's status, after its
Done; both clients hand the Done over and end the stream quietly, as for an OK
request, so the Done is where a caller reads the outcome. Only a status without
a Done (authentication, the server going away) is raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.client.content import needs_stream
from orchestrator.client.requests import make_request, stream_inputs
from orchestrator.client.results import Result
from orchestrator.client.targets import CLIENT_OPTIONS, target
from services.mesh.errors import status_code
from services.mesh.pb.omni.v1 import orchestrator_pb2, orchestrator_pb2_grpc, stage_pb2
from services.mesh.security import PLAINTEXT, Dialing, token_metadata

DEFAULT_ADDRESS = "127.0.0.1:50050"
ORCHESTRATOR_SERVICE = "omni.v1.Orchestrator"  # its readiness in grpc health


def _repeats(error: grpc.RpcError, done: orchestrator_pb2.Done | None) -> bool:
    """The RPC's status is the one its Done already reported."""
    return done is not None and error.code() == status_code(done.code)


class Events:
    """An async stream of one request's events, ending with its Done; ``collect()``
    gathers them, ``cancel()`` ends the call (the orchestrator cancels the request)."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall, request_id: str = ""
    ) -> None:
        self._call = call
        self.request_id = request_id  # as sent ("": the orchestrator assigns one)

    async def __aiter__(self) -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
        done = None
        try:
            async for event in self._call:
                if event.WhichOneof("kind") == "done":
                    done = event.done
                yield event
        except grpc.aio.AioRpcError as exc:
            if not _repeats(exc, done):
                raise

    def cancel(self) -> None:
        self._call.cancel()

    async def collect(self) -> Result:
        result = Result()
        async for event in self:
            result.add(event)
        return result


class AsyncClient:
    """``dialing``: TLS and the bearer token (``security.client_dialing``); every
    call carries the token. ``generate(..., timeout_s=T)`` sets a deadline that
    the orchestrator passes on to the stages."""

    def __init__(
        self, address: str | Sequence[str] = DEFAULT_ADDRESS, dialing: Dialing = PLAINTEXT
    ) -> None:
        self.address = target(address)
        self.channel = dialing.channel(self.address, CLIENT_OPTIONS)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.metadata = dialing.metadata

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs: Any
    ) -> Events:
        return self.send(make_request(prompt, **kwargs), timeout_s=timeout_s)

    def send(
        self,
        request: orchestrator_pb2.GenerateRequest,
        *,
        timeout_s: float | None = None,
        token: str | None = None,
    ) -> Events:
        """``request`` as it is; ``token``: this call's bearer token instead of the
        dialing's (a gateway passing its caller's on)."""
        metadata = self.metadata if token is None else token_metadata(token)
        if needs_stream(request.inputs):  # large media: chunks, never one large message
            messages = stream_inputs(request)
            stream = self.stub.GenerateStream(messages, timeout=timeout_s, metadata=metadata)
            return Events(stream, messages[-1].submit.request_id)
        call = self.stub.Generate(request, timeout=timeout_s, metadata=metadata)
        return Events(call, request.request_id)

    async def abort(self, *request_ids: str) -> stage_pb2.AbortResponse:
        request = stage_pb2.AbortRequest(request_ids=request_ids)
        return await self.stub.Abort(request, metadata=self.metadata)

    async def list_stages(self) -> list[orchestrator_pb2.StageStatus]:
        return list((await self.pipeline()).stages)

    async def pipeline(self, *, token: str | None = None) -> orchestrator_pb2.ListStagesResponse:
        """The pipeline's name and its stages (``token``: as for ``generate``)."""
        request = orchestrator_pb2.ListStagesRequest()
        metadata = self.metadata if token is None else token_metadata(token)
        return await self.stub.ListStages(request, metadata=metadata)

    def watch_stages(self) -> AsyncIterator[orchestrator_pb2.StageStatus]:
        request = orchestrator_pb2.WatchStagesRequest()
        return self.stub.WatchStages(request, metadata=self.metadata)

    async def serving(self) -> bool:
        """The orchestrator's readiness (grpc health of omni.v1.Orchestrator)."""
        request = health_pb2.HealthCheckRequest(service=ORCHESTRATOR_SERVICE)
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(request)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def pause(self) -> None:
        request = orchestrator_pb2.PauseGenerationRequest()
        await self.stub.PauseGeneration(request, metadata=self.metadata)

    async def resume(self) -> None:
        request = orchestrator_pb2.ResumeGenerationRequest()
        await self.stub.ResumeGeneration(request, metadata=self.metadata)

    async def wait_ready(self, timeout_s: float = 600.0) -> list[orchestrator_pb2.StageStatus]:
        """Until every stage is READY and the orchestrator serves; raises RuntimeError
        naming a FAILED stage."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                stages = await self.list_stages()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                stages = []
            failed = [s for s in stages if s.state == orchestrator_pb2.STAGE_FAILED]
            if failed:
                raise RuntimeError("; ".join(f"stage {s.name}: {s.message}" for s in failed))
            if stages and all(s.state == orchestrator_pb2.STAGE_READY for s in stages):
                if await self.serving():
                    return stages
            if time.monotonic() > deadline:
                raise TimeoutError(f"orchestrator at {self.address} not ready in {timeout_s:.0f}s")
            await asyncio.sleep(0.2)


class Client:
    """The blocking twin of AsyncClient."""

    def __init__(
        self, address: str | Sequence[str] = DEFAULT_ADDRESS, dialing: Dialing = PLAINTEXT
    ) -> None:
        self.address = target(address)
        self.channel = dialing.sync_channel(self.address, CLIENT_OPTIONS)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.metadata = dialing.metadata

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(
        self, prompt: str | None = None, **kwargs: Any
    ) -> Iterator[orchestrator_pb2.GenerateEvent]:
        request = make_request(prompt, **kwargs)
        if needs_stream(request.inputs):  # large media: chunks, never one large message
            call = self.stub.GenerateStream(iter(stream_inputs(request)), metadata=self.metadata)
        else:
            call = self.stub.Generate(request, metadata=self.metadata)
        done = None
        try:
            for event in call:
                if event.WhichOneof("kind") == "done":
                    done = event.done
                yield event
        except grpc.RpcError as exc:
            if not _repeats(exc, done):
                raise

    def collect(self, prompt: str | None = None, **kwargs: Any) -> Result:
        result = Result()
        for event in self.generate(prompt, **kwargs):
            result.add(event)
        return result

    def abort(self, *request_ids: str) -> stage_pb2.AbortResponse:
        request = stage_pb2.AbortRequest(request_ids=request_ids)
        return self.stub.Abort(request, metadata=self.metadata)

    def list_stages(self) -> list[orchestrator_pb2.StageStatus]:
        request = orchestrator_pb2.ListStagesRequest()
        return list(self.stub.ListStages(request, metadata=self.metadata).stages)

    def pause(self) -> None:
        self.stub.PauseGeneration(orchestrator_pb2.PauseGenerationRequest(), metadata=self.metadata)

    def resume(self) -> None:
        request = orchestrator_pb2.ResumeGenerationRequest()
        self.stub.ResumeGeneration(request, metadata=self.metadata)
