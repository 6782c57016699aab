"""One way to build a gRPC server of the mesh, used by the stage and the orchestrator.

Every server gets the same things, set here once: keepalive (idle clients are
pinged, so a vanished client's streams end; clients may ping every second), a
receive limit, the connection limits (``rpc/limits.py``: connections capped below
the descriptor limit, which is first raised to the hard one; streams per
connection; idle connections closed), the decoding interceptor (an undecodable
frame is INVALID_ARGUMENT naming the message), then the auth interceptor, then
the reads interceptor (``rpc/reads.py``: no message read before the caller is
checked, the first one within a deadline, a unary one paid for from an input
budget before it is read), gRPC health (one servicer, also behind an optional
plaintext probe port) and reflection. The caller adds its own servicer and
decides what health says.

The probe port (``--health-port``): with TLS on, a stage requires a client
certificate and the orchestrator a TLS handshake on their main port, but
Kubernetes' native gRPC probes (and most load balancers' health checks) dial
plaintext and present no certificate. Rather than open the main port to them, a
server can also listen on a port that carries nothing but health: the same
servicer object as the main port, so both always agree, and no other method
(reflection included), so the port reveals only SERVING / NOT_SERVING per name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.mesh.data.byte_budget import InputBudget
from services.mesh.process import raise_descriptor_limit
from services.mesh.rpc.decoding import DecodingInterceptor, request_names
from services.mesh.rpc.limits import ConnectionLimits
from services.mesh.rpc.reads import ReadsInterceptor
from services.mesh.security import AuthInterceptor

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Health of the process itself (not of its readiness), for liveness probes.
LIVENESS_SERVICE = "liveness"

# Keepalive on every server: ping idle clients (a vanished client's streams are
# ended), and let clients ping as often as every second (the default would
# answer a client's keepalive pings with GOAWAY "too many pings").
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# The plaintext probe port: a probe dials, asks, hangs up.
PROBE_LIMITS = ConnectionLimits(
    max_connections=64, max_streams_per_connection=4, max_calls=64, max_connection_idle_s=60.0
)


def bind(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind ``host:port`` (0: a free port), with TLS when ``credentials`` are given;
    OSError naming the address if it is taken."""
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # grpc's way of saying the address is in use or invalid
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use, or not an address of this host)")
    return bound


class MeshServer:
    """A gRPC server with the mesh's options, interceptors, health and reflection.

    ``service``: the main service it serves (its descriptor); ``also``: the
    descriptors of any other it serves beside it (listed by reflection too);
    ``auth``: the interceptor that checks each caller; ``limits``: what callers
    may hold; ``budget``: what the service's unary requests are charged to while
    read and held (None: nothing); ``options``: gRPC server arguments of this
    server beyond the common ones (they win over ``limits``)."""

    def __init__(
        self,
        service: Any,
        auth: AuthInterceptor,
        *,
        max_receive_bytes: int,
        limits: ConnectionLimits | None = None,
        budget: InputBudget | None = None,
        options: Sequence[tuple[str, Any]] = (),
        also: Sequence[Any] = (),
    ) -> None:
        self.service_name: str = service.full_name
        self.limits = limits = limits or ConnectionLimits()
        self.descriptors = raise_descriptor_limit()
        self.health = health.aio.HealthServicer()
        self.reads = ReadsInterceptor(
            auth.authenticator,
            receive_bytes=max_receive_bytes,
            first_message_timeout_s=limits.first_message_timeout_s,
            budget=budget,
        )
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_receive_bytes),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
                *SERVER_KEEPALIVE_OPTIONS,
                *limits.options(self.descriptors),
                *options,
            ],
            interceptors=[DecodingInterceptor(request_names(service, *also)), auth, self.reads],
            maximum_concurrent_rpcs=limits.max_calls,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (self.service_name, *(s.full_name for s in also))
        reflection.enable_server_reflection(
            (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self._probe: grpc.aio.Server | None = None
        self.port = 0
        self.health_port: int | None = None

    def add(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> None:
        """Serve ``servicer`` (``register`` is the stub module's ``add_*_to_server``)."""
        register(servicer, self.server)

    async def set_health(self, statuses: Mapping[str, bool]) -> None:
        """SERVING or NOT_SERVING per health service name ("" is the server's)."""
        for name, serving in statuses.items():
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    def bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
        self.port = bind(self.server, host, port, credentials)
        return self.port

    async def start(self, host: str, health_port: int | None = None) -> None:
        """Start serving on the bound port; ``health_port``: also serve health
        alone, plaintext, there (0 picks a port). OSError names a taken address."""
        await self.server.start()
        if health_port is not None:
            self._probe = grpc.aio.server(
                options=[
                    ("grpc.so_reuseport", 0),
                    # A health request is a few bytes: nothing larger is worth reading.
                    ("grpc.max_receive_message_length", 4096),
                    *PROBE_LIMITS.options(self.descriptors),
                ],
                maximum_concurrent_rpcs=PROBE_LIMITS.max_calls,
            )
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._probe)
            self.health_port = bind(self._probe, host, health_port)
            await self._probe.start()
            logger.info("health (plaintext, health only) on %s:%d", host, self.health_port)

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace_s: float | None) -> None:
        await self.server.stop(grace_s)
        if self._probe is not None:
            await self._probe.stop(None)
