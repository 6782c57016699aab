"""An asyncio client for one Stage service, for the orchestrator, tools and tests.

Every channel sends keepalive pings, so a stage that stops answering (SIGSTOP,
a dead node, a cut cable) fails its calls with UNAVAILABLE within about
``keepalive_s`` plus the ping timeout instead of leaving them waiting forever.
How it authenticates (TLS, the mesh token) is a ``Dialing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from services.mesh.data.chunk_wire import STAGE_OUTPUT_CHUNK, deserializer, serializer
from services.mesh.errors import InitFailed
from services.mesh.pb.omni.v1 import stage_pb2, stage_pb2_grpc
from services.mesh.security import PLAINTEXT, Dialing

# round_robin: a target that resolves to several replicas (``dns:///svc:port`` of a
# headless Service, ``ipv4:a:p,b:p``) gets a connection to each, and every call (one
# request's Generate stream) goes to the next ready one. pick_first, gRPC's default,
# would pin every request to the first address. One address: the same as pick_first.
KEEPALIVE_S = 10.0  # idle seconds before a ping; an unanswered ping fails the calls
# Reconnecting to a stage that went away: gRPC's own backoff grows to two minutes,
# so a stage restarted after 15 s could wait as long again before its channel
# tried it, while its monitor (on a fresh channel) already said READY. A stage is
# on this node or in this cluster: trying it again every second costs nothing.
RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 1000
READINESS_SERVICE = "omni.v1.Stage"  # the health name a stage turns SERVING when READY
GENERATE = "/omni.v1.Stage/Generate"
GENERATE_ATTEMPTS = 3  # a request's Generate calls in all, when one finds a dead replica


def service_config(health_service: str | None = None) -> str:
    """round_robin; with ``health_service``, gRPC's client-side health checking too:
    the channel watches that name on every replica and picks only those SERVING."""
    config: dict[str, object] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if health_service is not None:
        config["healthCheckConfig"] = {"serviceName": health_service}
    return json.dumps(config)


def channel_options(
    keepalive_s: float = KEEPALIVE_S, health_service: str | None = None
) -> list[tuple[str, int | str]]:
    """Options of every channel of ours: no message size limit, keepalive on."""
    interval_ms = max(int(keepalive_s * 1000), 1000)
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.service_config", service_config(health_service)),
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", interval_ms),
        # gRPC >= 1.6x times an unanswered ping out by this, not keepalive_timeout_ms.
        ("grpc.http2.ping_timeout_ms", interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_MIN_MS),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_MIN_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ]


CHANNEL_OPTIONS = channel_options()


class StageClient:
    """A channel to one stage: ``host:port``, or any gRPC target naming its replicas.

    ``route_by_health`` (the orchestrator's): new Generate streams go on a second
    channel that picks only replicas whose readiness is SERVING, so a replica that
    is starting, waiting for its device or draining gets no new request, while
    InitStatus, health, Describe, Load, Abort and ReleaseTensors keep the plain
    channel, which reaches a replica in any state (a draining one still frees its
    blocks).
    """

    def __init__(
        self,
        address: str,
        dialing: Dialing = PLAINTEXT,
        *,
        keepalive_s: float = KEEPALIVE_S,
        route_by_health: bool = False,
    ) -> None:
        self.address = address
        self.channel = dialing.channel(address, channel_options(keepalive_s))
        self.stub = stage_pb2_grpc.StageStub(self.channel)
        self.serving_channel = (
            dialing.channel(address, channel_options(keepalive_s, READINESS_SERVICE))
            if route_by_health
            else self.channel
        )
        # Generate as the stub has it, except that chunks are encoded and read by
        # hand (chunk_wire): their payloads are copied once each way, not 3 and 2 times.
        self._generate = self.serving_channel.stream_stream(
            GENERATE,
            request_serializer=serializer(stage_pb2.StageInput.SerializeToString),
            response_deserializer=deserializer(
                STAGE_OUTPUT_CHUNK, stage_pb2.StageOutput.FromString
            ),
        )
        if route_by_health:
            # Connect and learn every replica's health now, not at the first request:
            # by then round_robin knows all the replicas that serve.
            self.serving_channel.get_state(try_to_connect=True)
        self.metadata = dialing.metadata

    async def close(self) -> None:
        await self.channel.close()
        if self.serving_channel is not self.channel:
            await self.serving_channel.close()

    async def __aenter__(self) -> StageClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def init_events(self) -> AsyncIterator[stage_pb2.InitEvent]:
        return self.stub.InitStatus(stage_pb2.InitStatusRequest(), metadata=self.metadata)

    async def wait_ready(self, timeout_s: float | None = None) -> list[stage_pb2.InitEvent]:
        """Follow InitStatus to READY; raises InitFailed with the stage's reason."""

        async def follow() -> list[stage_pb2.InitEvent]:
            seen: list[stage_pb2.InitEvent] = []
            async for event in self.init_events():
                seen.append(event)
                if event.phase == stage_pb2.FAILED:
                    raise InitFailed(f"stage {event.stage} failed: {event.reason}")
                if event.phase == stage_pb2.READY:
                    return seen
            raise InitFailed(f"stage at {self.address} ended InitStatus before READY")

        return await asyncio.wait_for(follow(), timeout_s)

    async def describe(self) -> stage_pb2.StageDescription:
        return await self.stub.Describe(stage_pb2.DescribeRequest(), metadata=self.metadata)

    async def load(self, timeout_s: float | None = None) -> stage_pb2.StageLoad:
        return await self.stub.Load(
            stage_pb2.LoadRequest(), timeout=timeout_s, metadata=self.metadata
        )

    async def abort(self, *request_ids: str) -> stage_pb2.AbortResponse:
        request = stage_pb2.AbortRequest(request_ids=request_ids)
        return await self.stub.Abort(request, metadata=self.metadata)

    async def release_tensors(
        self, request: stage_pb2.ReleaseTensorsRequest, timeout_s: float | None = None
    ) -> stage_pb2.ReleaseTensorsResponse:
        return await self.stub.ReleaseTensors(request, timeout=timeout_s, metadata=self.metadata)

    def open_stream(
        self, timeout_s: float | None = None, *, wait_for_ready: bool = False
    ) -> grpc.aio.StreamStreamCall:
        """A raw bidirectional Generate call: ``write``, ``done_writing``, iterate.
        ``timeout_s``: its deadline (the orchestrator's long-lived shared streams
        have none: each request's rides on its Submit, ``timeout_ms``).
        ``wait_for_ready``: a channel still connecting (to a stage just restarted)
        holds the call until it is connected instead of failing it at once."""
        return self._generate(
            timeout=timeout_s, metadata=self.metadata, wait_for_ready=wait_for_ready
        )

    async def generate(self, submit: stage_pb2.Submit) -> AsyncIterator[stage_pb2.StageOutput]:
        """One request on its own stream; yields its events through the final one.

        A call that fails UNAVAILABLE before any event of it arrived (the replica it
        went to had died, its connection not yet seen closed) goes again, to the next
        replica round_robin picks, up to GENERATE_ATTEMPTS times in all, as the
        orchestrator moves a request a dead replica had not started."""
        if not submit.is_last:
            submit.is_last = True
        for attempt in range(1, GENERATE_ATTEMPTS + 1):
            answered = False
            try:
                async with contextlib.aclosing(self._one_call(submit)) as outputs:
                    async for output in outputs:
                        answered = True
                        yield output
                return
            except grpc.aio.AioRpcError as exc:
                again = exc.code() == grpc.StatusCode.UNAVAILABLE and not answered
                if not again or attempt == GENERATE_ATTEMPTS:
                    raise

    async def _one_call(self, submit: stage_pb2.Submit) -> AsyncGenerator[stage_pb2.StageOutput]:
        call = self.open_stream()
        try:
            try:
                await call.write(stage_pb2.StageInput(submit=submit))
                await call.done_writing()
            except grpc.aio.AioRpcError:
                # The stage ended the call before taking the request (it refused the
                # caller, say): the write fails generically, the call's status says why
                # (unless grpcio's aio client let the write's INTERNAL overwrite it,
                # grpc/grpc#36066: then INTERNAL is all there is to report).
                raise await _ended(call) from None
            async for output in call:
                yield output
        finally:
            call.cancel()


async def _ended(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    """The error a finished call ended with, as reading it would raise."""
    return grpc.aio.AioRpcError(
        await call.code(),
        await call.initial_metadata(),
        await call.trailing_metadata(),
        await call.details(),
    )


def chat_submit(request_id: str, prompt: str, **params: object) -> stage_pb2.Submit:
    """A one-message chat request with the given GenerationParams fields."""
    return stage_pb2.Submit(
        request_id=request_id,
        inputs=stage_pb2.StageInputs(messages=[stage_pb2.ChatMessage(role="user", content=prompt)]),
        params=stage_pb2.GenerationParams(**params),  # type: ignore[arg-type]
        is_last=True,
    )
