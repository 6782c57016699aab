"""Free ports for test servers. ``free_port``: one on 127.0.0.1. ``shared_port``: a
port free on several loopback addresses at once, for replicas that share one
port on 127.0.0.1, 127.0.0.2, … (as a Service's Pods share theirs). A port free on
127.0.0.1 alone may be another test's on 127.0.0.2: each address hands out its
ephemeral ports on its own, and gRPC listeners share a port (SO_REUSEPORT) with
whoever else asks for it, so the collision would not even fail the bind."""

from __future__ import annotations

import re
import socket
from contextlib import ExitStack
from pathlib import Path

LOOPBACKS = ("127.0.0.1", "127.0.0.2")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def shared_port(hosts: tuple[str, ...] = LOOPBACKS, tries: int = 50) -> int:
    for _ in range(tries):
        with ExitStack() as probes:
            first = probes.enter_context(socket.socket())
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            try:
                for host in hosts[1:]:
                    probes.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no port free on all of {', '.join(hosts)}")


def stage_port(run_dir: Path, stage: str) -> int:
    """The gRPC port of ``omni up``'s stage ``stage``, as its log (``RUN/<stage>.log``)
    says: the stage process also listens on its data port (services/mesh/data/pull.py),
    so its listening sockets alone do not tell which is which."""
    said = re.search(
        rf"stage {re.escape(stage)} listening on \S+:(\d+)", (run_dir / f"{stage}.log").read_text()
    )
    if said is None:
        raise RuntimeError(f"{run_dir / f'{stage}.log'} does not say where stage {stage} listens")
    return int(said.group(1))
