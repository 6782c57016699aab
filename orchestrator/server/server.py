"""The orchestrator process's server: ``OrchestratorServer`` owns the gRPC server,
one channel and one monitor per stage, and the router: ``start()``, ``wait()``,
``stop()``. Health is NOT_SERVING until every stage is READY and described;
the monitors are the one truth about each stage: the router routes only to
stages they say are READY (a request waits a while for one that restarts:
``requests/gate.py``), and a stage whose process is gone fails the requests it
held. The service's methods are thin adapters over these (``orchestrator.server.servicer``).
Beside it, on the same port, KEDA's external-scaler service tells each stage's
demand (``orchestrator.server.scaling``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import grpc

from orchestrator.server.peers import Peers
from orchestrator.server.pipeline import PipelineConfig
from orchestrator.server.requests.gate import StageGate
from orchestrator.server.requests.router import Router
from orchestrator.server.requests.topology import unoffered
from orchestrator.server.scaling.demand import StageDemand
from orchestrator.server.scaling.keda import SCALER, ExternalScaler
from orchestrator.server.servicer import OrchestratorServicer
from orchestrator.server.stages.monitor import StageMonitor, StageTarget
from orchestrator.server.stages.replicas import ReplicaSet, ReplicaSettings
from orchestrator.server.stages.resolver import Lookup, system_lookup
from orchestrator.server.stages.watchdog import WatchdogSettings
from services.mesh.data.byte_budget import InputBudget
from services.mesh.data.chunks import CHUNK_BYTES
from services.mesh.data.malloc import FreedMemory
from services.mesh.data.node import mesh_id
from services.mesh.data.ref_reader import RefReader
from services.mesh.errors import InitFailed
from services.mesh.pb.externalscaler import externalscaler_pb2_grpc
from services.mesh.pb.omni.v1 import orchestrator_pb2, orchestrator_pb2_grpc, stage_pb2
from services.mesh.rpc.server import LIVENESS_SERVICE, MeshServer
from services.mesh.rpc.stage_client import StageClient
from services.mesh.security import (
    AuthInterceptor,
    SecuritySettings,
    admin_only,
    anyone,
    mesh_dialing,
    orchestrator_authenticator,
    server_credentials,
)

logger = logging.getLogger(__name__)

ORCHESTRATOR = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"]
ORCHESTRATOR_SERVICE = ORCHESTRATOR.full_name
# With client tokens on, every Orchestrator method needs one; pausing needs an
# admin's. Health and reflection stay open for probes.
RULES = {
    f"/{ORCHESTRATOR_SERVICE}/{method.name}": (
        admin_only if method.name in ("PauseGeneration", "ResumeGeneration") else anyone
    )
    for method in ORCHESTRATOR.methods
}


class OrchestratorServer:
    def __init__(
        self,
        pipeline: PipelineConfig,
        *,
        client_high_watermark: int = 256,
        client_low_watermark: int = 64,
        mesh: str | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        security: SecuritySettings | None = None,
        peers: str = "",
        lookup: Lookup = system_lookup,
    ) -> None:
        missing = [s.name for s in pipeline.stages if not s.address]
        if missing:
            raise ValueError(
                f"stages without an address: {', '.join(missing)} (omni up fills them in)"
            )
        self.pipeline = pipeline
        # Events buffered per client stream before the stages are held back.
        self.client_watermarks = (client_high_watermark, client_low_watermark)
        # The front door: no client message beyond this (gRPC answers RESOURCE_EXHAUSTED
        # before it is read), nor more chunked input held at once on one stream...
        runtime = pipeline.runtime
        self.max_message_bytes = runtime.max_message_bytes
        self.max_input_bytes = runtime.max_input_bytes
        # ... and no more client input (unary messages, chunks, windows) held at once
        # by the whole process; a burst of large inputs, once given back, is given
        # back to the system too (malloc keeps freed buffers otherwise).
        self.freed = FreedMemory()
        self.input_budget = InputBudget(
            runtime.max_process_input_bytes,
            "runtime.max_process_input_bytes",
            on_release=self.freed.released,
        )
        # The pipeline file's security section, then OMNI_* env (a mounted secret).
        self.security = security or pipeline.security.with_env()
        self.authenticator = orchestrator_authenticator(self.security)
        dialing = mesh_dialing(self.security)
        if self.authenticator.enabled and dialing.token is None and dialing.credentials is None:
            logger.warning(
                "client tokens are on but there is no mesh token nor TLS toward the stages: "
                "a stage without its own auth serves anyone who reaches its port "
                "(set security.mesh_token_file here and in every stage, or use omni up)"
            )
        # The other orchestrators over these stages (a gRPC target; "" none): an Abort,
        # a Pause or a Resume landing here reaches what they hold too.
        self.peers = Peers(peers, dialing)
        addresses = {s.name: s.address or "" for s in pipeline.stages}
        self.clients = {
            name: StageClient(address, dialing, route_by_health=True)
            for name, address in addresses.items()
        }
        # Every replica of each stage, each dialled on its own: requests go to them.
        self.replicas = {
            s.name: ReplicaSet(
                s.name,
                addresses[s.name],
                dialing,
                ReplicaSettings(routing=s.routing, affinity=s.affinity),
                pods=s.pods,
                lookup=lookup,
            )
            for s in pipeline.stages
        }
        settings = WatchdogSettings  # one per stage: budgets differ
        # In the order ListStages lists them: the entry first, then as requests reach
        # them (a chart writes its stages alphabetically), then the stages alone.
        stages = sorted(pipeline.stages, key=lambda s: pipeline.listed.index(s.name))
        self.monitors = {
            s.name: StageMonitor(
                StageTarget(
                    s.name,
                    addresses[s.name],
                    settings(
                        init_timeout_s=s.init_timeout_s,
                        stall_timeout_s=s.download_stall_timeout_s,
                        paused_phases=frozenset(pipeline.watchdog.paused_phases),
                    ),
                ),
                dialing=dialing,
            )
            for s in stages
        }
        for name, replica_set in self.replicas.items():
            self.monitors[name].replicas = replica_set.statuses
            replica_set.on_change(self.monitors[name].replicas_changed)
        # What each stage says of itself once READY (Describe): where it runs (who
        # can open whose refs) and the transforms it offers.
        self.descriptions: dict[str, stage_pb2.StageDescription] = {}
        # Stages the pipeline cannot use as they are (an edge's transform they do
        # not offer), with why: a configuration error, not the stage's failure.
        self.misconfigured: dict[str, str] = {}
        refs = RefReader(mesh or mesh_id(), token=dialing.token)
        self.gate = StageGate(self.monitors, self.descriptions, runtime.ready_wait_s)
        self.router = Router(
            pipeline,
            self.clients,
            self.replicas,
            self.gate,
            describe=self.descriptions.get,
            refs=refs,
            chunk_bytes=chunk_bytes,
            max_pause_s=self.security.max_pause_s,
        )
        # What each stage is asked for (waiting + in flight), for KEDA's scaler.
        self.scaler = ExternalScaler(StageDemand(self.gate, self.replicas), peers=self.peers)
        self._rpc: MeshServer | None = None  # once started
        self.health_port: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving = asyncio.Event()  # every stage READY and described
        self.port = 0

    def _ready(self, stage: str) -> bool:
        return self.gate.reason(stage) is None

    def stage_exited(self, stage: str, code: int | None) -> None:
        """Its launcher saw ``stage``'s process exit: DOWN now, not at a health poll."""
        self.monitors[stage].process_exited(code)

    async def _describe(self, name: str) -> None:
        """Learn what a READY stage says of itself; retried while it stays READY.
        A stage that does not offer its incoming edge's transform is failed."""
        delay = 0.2
        while self.monitors[name].ready and name not in self.descriptions:
            try:
                description = await self.clients[name].describe()
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                logger.warning(
                    "stage %s: Describe failed (%s); retrying in %.1fs", name, code, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            edge = self.pipeline.incoming(name)
            problem = None if edge is None else unoffered(edge, description)
            if problem is not None:
                logger.error("pipeline %s: %s", self.pipeline.name, problem)
                self.misconfigured[name] = problem
                self.monitors[name].refuse(problem)
                break
            self.misconfigured.pop(name, None)
            self.descriptions[name] = description
        await self._update_health()

    def _on_change(self, status: orchestrator_pb2.StageStatus) -> None:
        if status.state == orchestrator_pb2.STAGE_READY and status.name not in self.descriptions:
            self._spawn(self._describe(status.name))
        elif status.state != orchestrator_pb2.STAGE_READY:
            self.descriptions.pop(status.name, None)  # a restarted stage may live elsewhere
        if status.state == orchestrator_pb2.STAGE_DOWN and self.monitors[status.name].lost:
            # Its process is gone, and what it held with it. One that is slow or
            # draining keeps its requests: a hung one's streams fail by keepalive.
            failed = self.router.stage_lost(
                status.name,
                f"stage {status.name} at {status.address} is unavailable: {status.message}",
            )
            if failed:
                logger.warning(
                    "stage %s went down: failed %d in-flight request(s)", status.name, failed
                )
        self._spawn(self._update_health())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _update_health(self) -> None:
        self.gate.changed()  # a status or a description changed: waiting requests look
        ready = all(self._ready(name) for name in self.monitors)
        if ready:
            self._serving.set()
        else:
            self._serving.clear()
        if self._rpc is not None:
            await self._rpc.set_health({"": ready, ORCHESTRATOR_SERVICE: ready})

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, health_port: int | None = None
    ) -> int:
        """Bind and begin following the stages. ``health_port``: also serve health
        alone, plaintext, there (for probes that cannot do TLS)."""
        rpc = self._rpc = MeshServer(
            ORCHESTRATOR,
            AuthInterceptor(self.authenticator, RULES),
            max_receive_bytes=self.max_message_bytes,
            limits=self.pipeline.runtime.connections,
            budget=self.input_budget,
            # Without BDP probing a stream's window opens for the message being read
            # (gRPC sizes it to that message), not ahead of it: a call that waits for
            # the input budget leaves its message at the sender, as reads.py intends,
            # instead of gRPC buffering tens of MB of it (a wave's peak with and
            # without probing: docs/benchmarks.md).
            options=[("grpc.http2.bdp_probe", 0)],
            also=[SCALER],
        )
        servicer = OrchestratorServicer(self)
        rpc.add(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer)
        rpc.add(externalscaler_pb2_grpc.add_ExternalScalerServicer_to_server, self.scaler)
        credentials = server_credentials(self.security, require_client_cert=False)
        self.port = rpc.bind(host, port, credentials)
        await self._update_health()
        await rpc.set_health({LIVENESS_SERVICE: True})
        await rpc.start(host, health_port)
        self.health_port = rpc.health_port
        for replica_set in self.replicas.values():
            await replica_set.start()
        for monitor in self.monitors.values():
            monitor.on_change(self._on_change)
            await monitor.start()
        logger.info("orchestrator %s listening on %s:%d", self.pipeline.name, host, self.port)
        return self.port

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Every stage READY and described; InitFailed if a stage's init failed or a
        stage cannot take its incoming edge (``misconfigured``)."""

        async def ready() -> None:
            await asyncio.gather(*(m.wait_ready() for m in self.monitors.values()))
            while not self._serving.is_set():
                if self.misconfigured:
                    raise InitFailed("; ".join(self.misconfigured.values()))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await self._serving.wait()

        await asyncio.wait_for(ready(), timeout_s)

    async def wait(self) -> None:
        assert self._rpc is not None, "start() first"
        await self._rpc.wait()

    async def stop(self, grace_s: float = 5.0) -> None:
        """No new calls; every request in flight ends with its Done (UNAVAILABLE),
        which its client gets within ``grace_s``; then everything closes."""
        self.scaler.close()  # KEDA's streams end now, not at the grace's end
        stopping = None if self._rpc is None else asyncio.create_task(self._rpc.stop(grace_s))
        await self.router.stop(grace_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for monitor in self.monitors.values():
            await monitor.stop()
        for replica_set in self.replicas.values():
            await replica_set.stop()
        if stopping is not None:
            await stopping
        for client in self.clients.values():
            await client.close()
        await self.peers.close()
        self.freed.cancel()
