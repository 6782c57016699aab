"""What every Omni Mesh server process does the same way: log to stderr, and
run until SIGTERM or SIGINT asks it to stop (the up command uses these too)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

import grpc

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


def configure_logging() -> None:
    """One format for every process; the level comes from OMNI_LOG_LEVEL (INFO)."""
    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


PARENT_PID_ENV = "OMNI_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Stop (SIGTERM) when the process that launched us dies, even by SIGKILL.

    Launchers (``omni up``) set OMNI_PARENT_PID to their pid; without it this
    does nothing. Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op.
    """
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if str(os.getppid()) != expected:  # it died before the prctl: nobody will signal us
        os.kill(os.getpid(), signal.SIGTERM)


def stop_on_signals() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def announce(host: str, port: int) -> None:
    """The line launchers read to learn the bound port (``--port 0``)."""
    print(f"listening {host}:{port}", flush=True)


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
