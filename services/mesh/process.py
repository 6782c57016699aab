"""What every Omni Mesh server process does the same way: log to stderr, and
run until SIGTERM or SIGINT asks it to stop (the up command uses these too)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys


def configure_logging() -> None:
    """One format for every process; the level comes from OMNI_LOG_LEVEL (INFO)."""
    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


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
