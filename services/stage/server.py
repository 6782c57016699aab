"""The Stage gRPC service: thin adapters from the wire to StageRuntime, plus
health (readiness on omni.v1.Stage, liveness on "liveness") and reflection.

``StageServer`` owns everything a running stage holds: the gRPC server, the
engine, the init bus and the start-up task; ``start()``, ``wait()``, ``stop()``.
When the engine dies the stage turns FAILED (an InitStatus event with the
reason; readiness and liveness NOT_SERVING) and ``failed`` is set, on which
the process exits non-zero so that ``omni up`` or Kubernetes restarts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import torch

from services.engines.capabilities import WritesIntoBlocks, accepted_kinds, offered_voices
from services.engines.registry import engine_class
from services.mesh.data.chunk_wire import EncodedChunk, serializer
from services.mesh.data.node import node_identity
from services.mesh.errors import OmniError, abort_rpc
from services.mesh.pb.omni.v1 import stage_pb2, stage_pb2_grpc
from services.mesh.rpc.server import LIVENESS_SERVICE, MeshServer
from services.mesh.security import (
    AuthInterceptor,
    mesh_only,
    server_credentials,
    stage_authenticator,
)
from services.stage.config import StageConfig
from services.stage.serving.frames import InputFrame, read_input
from services.stage.serving.generate_rpc import GenerateStream
from services.stage.serving.runtime import StageRuntime
from services.stage.serving.tensor_io import StageTensors
from services.stage.serving.transforms import TRANSFORMS
from services.stage.startup.init_bus import InitBus
from services.stage.startup.phases import start_up

logger = logging.getLogger(__name__)

STAGE = stage_pb2.DESCRIPTOR.services_by_name["Stage"]
STAGE_SERVICE = STAGE.full_name
# Each client connection gets a GOAWAY after this long (calls in flight run on to their
# end; new ones take a new connection). A client that dials a stage's replicas by DNS
# (a headless Service) resolves again then, so replicas added since are found: gRPC's
# DNS resolver has no refresh period of its own.
MAX_CONNECTION_AGE_MS = 120_000
MAX_GRPC_BYTES = (1 << 31) - 1  # gRPC's message length limit is an int
# With mesh auth on, only the mesh (its client certificate or token) may run,
# abort or release anything, or read what the stage says of itself (Describe
# names its node, which a forged ref would copy). Health, reflection and
# InitStatus stay open: probes and operators watch a stage come up with them.
MESH_ONLY = {
    f"/{STAGE_SERVICE}/{method}": mesh_only
    for method in ("Generate", "Abort", "ReleaseTensors", "Describe", "Load")
}


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, runtime: StageRuntime, bus: InitBus, tensors: StageTensors) -> None:
        self._runtime = runtime
        self._bus = bus
        self._tensors = tensors
        self.streams_opened = 0  # Generate calls taken, ever (an orchestrator keeps a few)

    async def Generate(
        self,
        request_iterator: AsyncIterator[InputFrame],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[stage_pb2.StageOutput | EncodedChunk]:
        self.streams_opened += 1
        stream = GenerateStream(self._runtime, self._tensors)
        try:
            async for output in stream.run(request_iterator):
                yield output
        except OmniError as exc:  # the RPC itself fails (an undecodable frame)
            await abort_rpc(context, exc)

    async def InitStatus(
        self, request: stage_pb2.InitStatusRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.InitEvent]:
        async for event in self._bus.follow():
            yield event

    async def Describe(
        self, request: stage_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageDescription:
        config = self._runtime.config
        engine = self._runtime.engine
        return stage_pb2.StageDescription(
            name=config.name,
            engine=config.engine,
            model=config.model,
            phase=self._bus.phase,  # type: ignore[arg-type]
            max_batch_size=config.runtime.max_batch_size,
            max_queue_size=config.runtime.max_queue_size,
            supported_params=sorted(engine.supported_params),
            output_tensors=list(engine.output_tensors),
            node=node_identity(),
            load_format=config.load_format,
            transforms=[t.info() for t in TRANSFORMS.values()],
            accepts=sorted(accepted_kinds(engine)),
            voices=offered_voices(engine),
            compute=self._bus.compute,
        )

    async def ReleaseTensors(
        self, request: stage_pb2.ReleaseTensorsRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.ReleaseTensorsResponse:
        owner = request.request_id or None
        released = self._tensors.release(owner, list(request.names))
        return stage_pb2.ReleaseTensorsResponse(released=released)

    async def Load(
        self, request: stage_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageLoad:
        return stage_pb2.StageLoad(held=self._runtime.in_flight)

    async def Abort(
        self, request: stage_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.AbortResponse:
        response = stage_pb2.AbortResponse()
        for request_id in request.request_ids:
            if await self._runtime.cancel(request_id, "aborted"):
                response.aborted.append(request_id)
            else:
                response.not_found.append(request_id)
        return response


def add_stage_servicer(servicer: StageServicer, server: grpc.aio.Server) -> None:
    """As the generated ``add_StageServicer_to_server``, with two changes to
    Generate: both ways a TensorChunk frame is encoded and read by hand
    (``chunk_wire``, ``read_input``)."""
    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=read_input,
            # Chunks (EncodedChunk) are written straight from the tensor's memory.
            response_serializer=serializer(stage_pb2.StageOutput.SerializeToString),
        ),
        "InitStatus": grpc.unary_stream_rpc_method_handler(
            servicer.InitStatus,
            request_deserializer=stage_pb2.InitStatusRequest.FromString,
            response_serializer=stage_pb2.InitEvent.SerializeToString,
        ),
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe,
            request_deserializer=stage_pb2.DescribeRequest.FromString,
            response_serializer=stage_pb2.StageDescription.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=stage_pb2.AbortRequest.FromString,
            response_serializer=stage_pb2.AbortResponse.SerializeToString,
        ),
        "ReleaseTensors": grpc.unary_unary_rpc_method_handler(
            servicer.ReleaseTensors,
            request_deserializer=stage_pb2.ReleaseTensorsRequest.FromString,
            response_serializer=stage_pb2.ReleaseTensorsResponse.SerializeToString,
        ),
        "Load": grpc.unary_unary_rpc_method_handler(
            servicer.Load,
            request_deserializer=stage_pb2.LoadRequest.FromString,
            response_serializer=stage_pb2.StageLoad.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(STAGE_SERVICE, handlers),)
    )
    server.add_registered_method_handlers(STAGE_SERVICE, handlers)


class StageServer:
    def __init__(self, config: StageConfig) -> None:
        self.config = config
        if config.runtime.torch_threads is not None:
            torch.set_num_threads(config.runtime.torch_threads)
        self.engine = engine_class(config.engine)(config.engine_settings())
        self.runtime = StageRuntime(config, self.engine)
        self.tensors = StageTensors(config)
        if isinstance(self.engine, WritesIntoBlocks):
            self.engine.use_output_blocks(self.tensors)
        self._server: MeshServer | None = None
        self.servicer: StageServicer | None = None  # once started
        self._bus: InitBus | None = None
        self._startup: asyncio.Task[bool] | None = None
        self._watch: asyncio.Task[None] | None = None
        self.failed = asyncio.Event()  # the engine died: the process should exit non-zero
        self.port = 0
        self.health_port: int | None = None

    @property
    def bus(self) -> InitBus:
        assert self._bus is not None, "start() first"
        return self._bus

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, health_port: int | None = None
    ) -> int:
        """Bind at once (health NOT_SERVING), then bring the engine up in the background.
        ``health_port``: also serve health alone, plaintext, there (for probes)."""
        self._bus = InitBus(self.config.name, asyncio.get_running_loop())
        runtime = self.config.runtime
        # The transport admits a message as large as the stream may hold
        # (max_input_bytes), so that a Submit over max_message_bytes gets a
        # per-request RESOURCE_EXHAUSTED on a stream that goes on; only a message
        # the stream could never hold tears the stream down.
        transport_limit = min(
            max(runtime.max_input_bytes, 2 * runtime.max_message_bytes + (1 << 20)), MAX_GRPC_BYTES
        )
        security = self.config.security.with_env()
        server = MeshServer(
            STAGE,
            AuthInterceptor(stage_authenticator(security), MESH_ONLY),
            max_receive_bytes=transport_limit,
            limits=self.config.runtime.connections,
            options=[("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS)],
        )
        servicer = self.servicer = StageServicer(self.runtime, self._bus, self.tensors)
        server.add(add_stage_servicer, servicer)
        self.port = server.bind(host, port, server_credentials(security, require_client_cert=True))
        self._server = server
        await self._set_health(ready=False, alive=True)
        await server.start(host, health_port)
        self.health_port = server.health_port
        self.tensors.start(host)
        logger.info("stage %s listening on %s:%d", self.config.name, host, self.port)
        self._startup = asyncio.create_task(self._bring_up(), name="stage-startup")
        return self.port

    async def _bring_up(self) -> bool:
        ok = await start_up(self.config, self.engine, self.bus)
        if ok:
            self.runtime.ready = True
            await self._set_health(ready=True, alive=True)
            self._watch = asyncio.create_task(self._watch_engine(), name="engine-watch")
        else:
            self.runtime.not_ready_reason = "start-up failed (see InitStatus)"
            await self._set_health(ready=False, alive=False)
        return ok

    async def _watch_engine(self) -> None:
        await self.runtime.died.wait()
        death = self.runtime.death
        reason = death.message if death is not None else "the engine died"
        self.bus.publish(stage_pb2.FAILED, reason=f"the engine died: {reason}")
        await self._set_health(ready=False, alive=False)
        self.failed.set()

    async def _set_health(self, *, ready: bool, alive: bool) -> None:
        assert self._server is not None
        await self._server.set_health({"": ready, STAGE_SERVICE: ready, LIVENESS_SERVICE: alive})

    async def wait_ready(self) -> bool:
        assert self._startup is not None, "start() first"
        return await asyncio.shield(self._startup)

    async def wait(self) -> None:
        assert self._server is not None, "start() first"
        await self._server.wait()

    async def stop(self, grace_s: float | None = None) -> bool:
        """Drain: refuse new requests, let in-flight ones finish within the grace
        period, then close. True when nothing had to be cut off."""
        grace = self.config.runtime.drain_grace_s if grace_s is None else grace_s
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
            await asyncio.gather(self._startup, return_exceptions=True)
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        self.runtime.draining = True  # before readiness turns: a probe then sees it refused
        await self._set_health(ready=False, alive=not self.failed.is_set())
        drained = await self.runtime.drain(grace)
        if self._server is not None:
            await self._server.stop(min(grace, 1.0))
        await asyncio.to_thread(self.engine.close)
        await self.tensors.close()
        self.runtime.freed.cancel()
        return drained
