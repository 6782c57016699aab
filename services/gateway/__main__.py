"""``omni gateway`` (``python -m services.gateway``): the HTTP front door as its
own process. It binds at once and prints ``listening HOST:PORT`` (``--port 0``
picks a free port), serves until SIGTERM/SIGINT, then lets responses in flight
finish for ``--drain-s`` and exits 0; exit 2 for bad flags, 1 for a taken port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from pydantic import ValidationError

from services.gateway.app import create_app
from services.gateway.config import DEFAULT_MAX_BODY_BYTES, GatewayConfig, RealtimeLimits
from services.gateway.voices import parse_alias
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
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_BACKLOG = 2048


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni gateway",
        description="An OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models, "
        "/v1/images/generations, /v1/audio/speech) in front of an orchestrator.",
    )
    address = environment.ADDRESS.get()
    parser.add_argument(
        "--orchestrator",
        default=address or DEFAULT_ORCHESTRATOR,
        help="its gRPC address, or several orchestrators' (IP:PORT,IP:PORT or dns:NAME:PORT: "
        f"calls dealt in turn, moved off one that is gone) (default: $OMNI_ADDRESS, else "
        f"{DEFAULT_ORCHESTRATOR})",
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
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections (and requests in flight) served at once; past it a request is "
        "answered 503 at once, so a flood costs the mesh nothing and a client after it is "
        f"served (default {DEFAULT_MAX_CONNECTIONS}; keep it under the descriptor limit)",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=DEFAULT_BACKLOG,
        help=f"connections the kernel queues before accept (default {DEFAULT_BACKLOG})",
    )
    parser.add_argument(
        "--http",
        choices=("httptools", "h11"),
        default="httptools" if _installed("httptools") else "h11",
        help="uvicorn's HTTP/1.1 parser: httptools (C; the default when installed) or h11",
    )
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop" if _installed("uvloop") else "asyncio",
        help="the event loop: uvloop (the default when installed) or the standard library's",
    )
    parser.add_argument(
        "--drain-s", type=float, default=10.0, help="how long responses in flight get on SIGTERM"
    )
    realtime = parser.add_argument_group("/v1/realtime (docs/api.md)")
    limits = RealtimeLimits()
    realtime.add_argument(
        "--max-sessions",
        type=int,
        default=limits.max_sessions,
        help=f"realtime sessions at once; past it a session is closed 1013 (default "
        f"{limits.max_sessions})",
    )
    realtime.add_argument(
        "--session-idle-s",
        type=float,
        default=limits.idle_s,
        help="a session with no client event and no response this long is closed 1001",
    )
    realtime.add_argument(
        "--max-audio-buffer-bytes",
        type=int,
        default=limits.max_audio_buffer_bytes,
        help="input audio a session holds uncommitted; an append past it is refused",
    )
    realtime.add_argument(
        "--max-event-bytes",
        type=int,
        default=limits.max_event_bytes,
        help="one client event (WebSocket message); a larger one closes the session 1009",
    )
    realtime.add_argument(
        "--max-unread-bytes",
        type=int,
        default=limits.max_unread_bytes,
        help="server events a client leaves unread before its session is closed 1008",
    )
    realtime.add_argument(
        "--max-history-items",
        type=int,
        default=limits.max_items,
        help="conversation items a response sends the mesh (the oldest dropped first)",
    )
    realtime.add_argument(
        "--max-history-tokens",
        type=int,
        default=limits.max_history_tokens,
        help="tokens of conversation a response sends the mesh (the oldest dropped first)",
    )
    parser.add_argument(
        "--voice-alias",
        action="append",
        default=[],
        metavar="NAME=VOICE",
        help="a voice name clients may use for a voice of the speech stage (NAME= for its "
        "default); every OpenAI voice name is the default voice unless given here",
    )
    return parser


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process stops on SIGTERM
    and SIGINT like every server of the mesh, and exits 0 (uvicorn would re-raise
    the signal after its shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(host: str, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """A listening TCP socket, bound now (so --port 0 is known at once). Made with
    proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections whose socket
    says so, and without it each small SSE chunk waits out a delayed ACK (~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener


@dataclass(frozen=True)
class Listening:
    """How the HTTP server takes connections (uvicorn's settings of the same names)."""

    host: str
    port: int
    limit_concurrency: int
    backlog: int
    drain_s: float
    http: str = "httptools"
    ws_max_size: int = RealtimeLimits().max_event_bytes  # a larger WebSocket message: 1009


async def serve(config: GatewayConfig, listening: Listening) -> int:
    host, port = listening.host, listening.port
    try:
        listener = _listen(host, port, listening.backlog)
    except OSError as exc:
        print(f"omni gateway: {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1
    server = _Server(
        uvicorn.Config(
            create_app(config),
            log_config=None,  # ours (configure_logging)
            access_log=False,
            timeout_graceful_shutdown=max(1, round(listening.drain_s)),
            limit_concurrency=listening.limit_concurrency,
            backlog=listening.backlog,
            http=listening.http,
            ws_max_size=listening.ws_max_size,
            # permessage-deflate off: realtime events are mostly base64 PCM, which
            # compresses little, and zlib was most of the CPU the gateway spent a spoken
            # response (docs/benchmarks.md, Realtime).
            ws_per_message_deflate=False,
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
            realtime=RealtimeLimits(
                max_sessions=args.max_sessions,
                idle_s=args.session_idle_s,
                max_audio_buffer_bytes=args.max_audio_buffer_bytes,
                max_event_bytes=args.max_event_bytes,
                max_unread_bytes=args.max_unread_bytes,
                max_items=args.max_history_items,
                max_history_tokens=args.max_history_tokens,
            ),
            voice_aliases=dict(parse_alias(a) for a in args.voice_alias),
        )
        config.dialing  # noqa: B018 (reads the CA file: refused here, not at the first call)
    except (ValidationError, ConfigError, ValueError) as exc:
        print(f"omni gateway: {exc}", file=sys.stderr)
        return 2
    if args.max_connections < 1 or args.backlog < 1:
        print("omni gateway: --max-connections and --backlog: expected >= 1", file=sys.stderr)
        return 2
    listening = Listening(
        args.host,
        args.port,
        args.max_connections,
        args.backlog,
        args.drain_s,
        args.http,
        ws_max_size=args.max_event_bytes,
    )
    # uvloop and httptools: the C event loop and parser (gRPC's asyncio client
    # runs on either loop); benchmarks/gateway.py measures them beside h11 and asyncio.
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(config, listening))


if __name__ == "__main__":
    sys.exit(main())
