"""What every Omni Mesh server process does the same way: log to stderr, use
every file descriptor it is allowed, and run until SIGTERM or SIGINT asks it to
stop (the up command uses these too)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import resource
import signal
import sys
from typing import NoReturn

from services.mesh import environment

logger = logging.getLogger(__name__)


def configure_logging() -> None:
    """One format for every process; the level comes from OMNI_LOG_LEVEL (INFO)."""
    logging.basicConfig(
        level=environment.LOG_LEVEL.get(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# Where the hard limit is "unlimited", the soft one is raised this far (Linux
# refuses more than fs.nr_open, 1,048,576 by default).
_UNLIMITED_DESCRIPTORS = 1 << 20


def raise_descriptor_limit() -> int:
    """Raise the soft limit on open file descriptors to the hard one; returns the
    soft limit now. Each client connection holds a descriptor, and the usual soft
    limit (1,024) is what a few idle connections per client exhaust; the hard
    limit is what an operator meant to allow. Idempotent; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_DESCRIPTORS if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return _UNLIMITED_DESCRIPTORS if soft == resource.RLIM_INFINITY else soft


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Stop (SIGTERM) when the process that launched us dies, even by SIGKILL.

    Launchers (``omni up``) set OMNI_PARENT_PID to their pid; without it this
    does nothing. Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op.
    """
    expected = environment.PARENT_PID.get()
    if expected is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != expected:  # it died before the prctl: nobody will signal us
        os.kill(os.getpid(), signal.SIGTERM)


def parent_gone() -> bool:
    """Whether the launcher that started us (OMNI_PARENT_PID) has died: we were
    handed to another parent. Nobody is left to drain for then."""
    expected = environment.PARENT_PID.get()
    return expected is not None and os.getppid() != expected


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` once a server has stopped and freed what it holds, without
    the interpreter's own teardown: torch's and gRPC's took over a second of a
    stage's exit (stages of a killed `omni up` lingered for seconds)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


def port_number(text: str) -> int:
    """A TCP port, 0 (pick a free one) to 65535: argparse exits 2 naming the flag."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {port}")
    return port
