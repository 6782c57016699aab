"""``omni gateway`` (``python -m services.gateway``): the HTTP front door as its
own process. It binds at once and prints ``listening HOST:PORT`` (``--port 0``
picks a free port), serves until SIGTERM/SIGINT, then lets responses in flight
finish for ``--drain-s`` and exits 0; exit 2 for bad flags, 1 for a taken port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from pathlib import Path

import uvicorn
from pydantic import ValidationError

from services.gateway.app import create_app
from services.gateway.config import DEFAULT_MAX_BODY_BYTES, GatewayConfig
from services.mesh import environment
from services.mesh.config_files import ConfigError
from services.mesh.process import (
    announce,
    configure_logging,
    die_with_parent,
    port_number,
    stop_on_signals,
)

DEFAULT_ORCHESTRATOR = "127.0.0.1:50050"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni gateway",
        description="An OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models, "
        "/v1/images/generations) in front of an orchestrator.",
    )
    address = environment.ADDRESS.get()
    parser.add_argument(
        "--orchestrator",
        default=address or DEFAULT_ORCHESTRATOR,
        help=f"its gRPC address (default: $OMNI_ADDRESS, else {DEFAULT_ORCHESTRATOR})",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--cacert",
        type=Path,
        default=environment.CACERT.get(),
        help="speak TLS to the orchestrator, verified with this CA (default: $OMNI_CACERT)",
    )
    parser.add_argument("--tls", action="store_true", help="speak TLS, verified by system roots")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413",
    )
    parser.add_argument(
        "--drain-s", type=float, default=10.0, help="how long responses in flight get on SIGTERM"
    )
    return parser


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process stops on SIGTERM
    and SIGINT like every server of the mesh, and exits 0 (uvicorn would re-raise
    the signal after its shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket, bound now (so --port 0 is known at once). Made with
    proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections whose socket
    says so, and without it each small SSE chunk waits out a delayed ACK (~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


async def serve(config: GatewayConfig, host: str, port: int, drain_s: float) -> int:
    try:
        listener = _listen(host, port)
    except OSError as exc:
        print(f"omni gateway: {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1
    server = _Server(
        uvicorn.Config(
            create_app(config),
            log_config=None,  # ours (configure_logging)
            access_log=False,
            timeout_graceful_shutdown=max(1, round(drain_s)),
        )
    )
    stop = stop_on_signals()
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    announce(host, listener.getsockname()[1])
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging()
    die_with_parent()
    try:
        config = GatewayConfig(
            orchestrator=args.orchestrator,
            cacert=args.cacert,
            tls=args.tls,
            max_body_bytes=args.max_body_bytes,
        )
        config.dialing  # noqa: B018 (reads the CA file: refused here, not at the first call)
    except (ValidationError, ConfigError) as exc:
        print(f"omni gateway: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config, args.host, args.port, args.drain_s))


if __name__ == "__main__":
    sys.exit(main())
