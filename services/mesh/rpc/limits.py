"""What one server lets its callers hold: connections, streams, calls, and the time
a caller may take to say what it wants. Both servers take these (the pipeline
file's ``runtime.connections``; a stage gets the defaults) and ``MeshServer``
turns them into gRPC server arguments once.

Why each one: a connection costs a file descriptor, and a process out of
descriptors can neither accept clients nor dial its stages; an open stream
costs a call and its task even when it never sends a byte. So connections are
capped below the descriptor limit (``connection_cap``), a call that sends no
message within ``first_message_timeout_s`` is ended (a unary call, or a
stranger's stream: ``rpc/reads.py``), and a connection with no call left is
closed after ``max_connection_idle_s``.

What gRPC (1.85) cannot do: cap connections or streams per peer. The cap is per
server, so one address holding it keeps others out until its connections are
reaped (idle, or ``max_connection_age_s``); put a proxy or a NetworkPolicy in
front where a per-client limit matters.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.mesh.config_files import Frozen

# Descriptors never given to incoming connections: what the process needs for
# itself (its stage channels, log and cache files, shared blocks, pipes).
MIN_RESERVED_DESCRIPTORS = 64


class ConnectionLimits(Frozen):
    # Incoming connections held at once; beyond it a new one is closed at accept.
    # Lowered at start to what the descriptor limit leaves (connection_cap).
    max_connections: int = Field(2048, ge=1)
    # Concurrent streams (calls) one connection may open (HTTP/2 SETTINGS).
    max_streams_per_connection: int = Field(256, ge=1)
    # Calls the server runs at once, all connections together; beyond: RESOURCE_EXHAUSTED.
    max_calls: int = Field(10_000, ge=1)
    # A unary call (or a stranger's stream) with no message by then: DEADLINE_EXCEEDED.
    first_message_timeout_s: float = Field(30.0, gt=0)
    # A connection that has not finished its TLS and HTTP/2 handshake by then is closed.
    handshake_timeout_s: float = Field(10.0, gt=0)
    # A connection without a call for this long is closed (GOAWAY).
    max_connection_idle_s: float = Field(60.0, gt=0)
    # Every connection gets a GOAWAY at this age (None: never); its calls then have
    # the grace to finish (None: as long as they take) before it is closed.
    max_connection_age_s: float | None = Field(None, gt=0)
    max_connection_age_grace_s: float | None = Field(None, ge=0)

    def connection_cap(self, descriptors: int) -> int:
        """``max_connections``, lowered to leave the process a quarter of its
        ``descriptors`` (at least MIN_RESERVED_DESCRIPTORS) for its own use."""
        reserved = max(MIN_RESERVED_DESCRIPTORS, descriptors // 4)
        return max(1, min(self.max_connections, descriptors - reserved))

    def options(self, descriptors: int) -> list[tuple[str, Any]]:
        """gRPC server arguments for a process allowed ``descriptors`` open files."""
        options: list[tuple[str, Any]] = [
            ("grpc.max_allowed_incoming_connections", self.connection_cap(descriptors)),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.server_handshake_timeout_ms", _ms(self.handshake_timeout_s)),
            ("grpc.max_connection_idle_ms", _ms(self.max_connection_idle_s)),
        ]
        if self.max_connection_age_s is not None:
            options.append(("grpc.max_connection_age_ms", _ms(self.max_connection_age_s)))
        if self.max_connection_age_grace_s is not None:
            grace = _ms(self.max_connection_age_grace_s)
            options.append(("grpc.max_connection_age_grace_ms", grace))
        return options


def _ms(seconds: float) -> int:
    return max(1, min(int(seconds * 1000), 2**31 - 1))
