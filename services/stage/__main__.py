"""``python -m services.stage serve --config STAGE.yaml [--host H] [--port N]``

Binds at once and prints ``listening HOST:PORT`` on stdout (launchers read it
to learn a port picked with --port 0), then brings the engine up. SIGTERM or
SIGINT drains in-flight requests within runtime.drain_grace_s and exits 0
(a download in progress is stopped, its partial file kept for the next start);
if the launcher that started it has died (``omni up`` killed: the stage gets
SIGTERM then), there is nobody to drain for, and it stops at once.
A bad stage file exits 2 with a message naming the file and the key. A dead
engine (the stage turned FAILED after READY) exits 3, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.mesh.config_files import ConfigError
from services.mesh.data.malloc import keep_freed_memory
from services.mesh.data.node import mesh_id
from services.mesh.errors import InitFailed
from services.mesh.process import (
    announce,
    configure_logging,
    die_with_parent,
    exit_now,
    parent_gone,
    port_number,
    stop_on_signals,
)
from services.mesh.telemetry import tracing
from services.stage.config import load_stage_config
from services.stage.server import StageServer

logger = logging.getLogger("services.stage")

EXIT_ENGINE_DEAD = 3


def _environment() -> None:
    try:
        mesh_id()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


async def serve(
    config_path: str,
    host: str,
    port: int,
    health_port: int | None = None,
    data_port: int | None = None,
) -> int:
    _environment()
    config = load_stage_config(config_path)
    if data_port is not None:
        runtime = config.runtime.model_copy(update={"data_port": data_port})
        config = config.model_copy(update={"runtime": runtime})
    try:
        server = StageServer(config)
    except (ValueError, InitFailed) as exc:  # the engine refused its settings
        message = exc.message if isinstance(exc, InitFailed) else str(exc)
        raise ConfigError(f"{config_path}: {message}") from None
    try:
        tracing.setup(f"omni-stage-{config.name}")
    except ValueError as exc:  # OMNI_PROMETHEUS_PORT
        raise ConfigError(str(exc)) from None
    stop = stop_on_signals()
    announce(host, await server.start(host, port, health_port))
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(server.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if server.failed.is_set():
        logger.error("stage %s: the engine died; exiting to be restarted", config.name)
    grace = 0.0 if parent_gone() else config.runtime.drain_grace_s
    if grace == 0.0:
        logger.warning("stage %s: its launcher is gone; stopping without a drain", config.name)
    logger.info("stage %s: stopping (draining up to %.1fs)", config.name, grace)
    drained = await server.stop(grace)
    logger.info("stage %s: stopped%s", config.name, "" if drained else " (some requests cut off)")
    return EXIT_ENGINE_DEAD if server.failed.is_set() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni stage", description="Run one Omni Mesh stage.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="serve a stage over gRPC")
    serve_cmd.add_argument("--config", required=True, help="the stage file (YAML)")
    serve_cmd.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)"
    )
    serve_cmd.add_argument(
        "--port", type=port_number, default=50051, help="port to bind; 0 picks a free one"
    )
    serve_cmd.add_argument(
        "--health-port",
        type=port_number,
        help="also serve grpc.health.v1 alone, plaintext, on this port (probes under TLS)",
    )
    serve_cmd.add_argument(
        "--data-port",
        type=port_number,
        help="where stages on other nodes pull this stage's large tensors "
        "(default: the stage file's runtime.data_port; 0 there picks a free one)",
    )
    args = parser.parse_args(argv)
    die_with_parent()
    configure_logging()
    keep_freed_memory()  # tensors in and out reuse warm buffers
    try:
        return asyncio.run(
            serve(args.config, args.host, args.port, args.health_port, args.data_port)
        )
    except ConfigError as exc:
        print(f"omni stage: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"omni stage: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    exit_now(main())
