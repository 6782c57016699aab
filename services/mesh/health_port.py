"""A second, plaintext port that serves only ``grpc.health.v1.Health``.

With TLS on, a stage requires a client certificate and the orchestrator a TLS
handshake on their main port, but Kubernetes' native gRPC probes (and most load
balancers' health checks) dial plaintext and present no certificate. Rather than
open the main port to them, each server can also listen on a probe port that
carries nothing but health: the same servicer object as the main port, so both
always agree, and no other method exists there (reflection included), so the
port reveals only SERVING / NOT_SERVING per service name. ``--health-port``
turns it on; the chart points its probes at it.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from services.mesh.process import bind

logger = logging.getLogger(__name__)


async def serve_health(
    servicer: health.aio.HealthServicer, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """Start the probe port; returns the server (stop it with the main one) and
    the port it bound (``port`` 0 picks one). OSError names the address if taken."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            # A health request is a few bytes: nothing larger is worth reading.
            ("grpc.max_receive_message_length", 4096),
        ]
    )
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = bind(server, host, port)
    await server.start()
    logger.info("health (plaintext, health only) listening on %s:%d", host, bound)
    return server, bound
