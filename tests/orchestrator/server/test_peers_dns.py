"""Peers named by DNS (as the chart's headless Service names them): every address
the name has now is reached, at the one port; a Pod gone from the name is let go.
Two real orchestrators on 127.0.0.1 and 127.0.0.2 at the same port, the lookup the
test's own (as a cluster's DNS would answer)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from orchestrator.server.peers import Peers
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from tests.helpers.ports import shared_port

NAME = "omni-orchestrator-peers.mesh.svc.cluster.local"


@pytest.fixture
async def two() -> AsyncIterator[tuple[list[OrchestratorServer], int]]:
    # No stage runs: Abort and Pause are the orchestrator's own, whatever its stages.
    pipeline = parse_pipeline(
        {"name": "dns", "stages": [{"name": "solo", "address": "127.0.0.1:1"}]}, "dns.yaml"
    )
    port = shared_port()
    servers = [OrchestratorServer(pipeline) for _ in range(2)]
    try:
        for server, host in zip(servers, ("127.0.0.1", "127.0.0.2"), strict=True):
            await server.start(host, port)
        yield servers, port
    finally:
        for server in servers:
            await server.stop(0.5)


async def test_a_dns_name_reaches_every_address_it_has_now(
    two: tuple[list[OrchestratorServer], int],
) -> None:
    servers, port = two
    answers: list[list[str] | None] = [["127.0.0.1", "127.0.0.2"]]

    async def lookup(host: str, asked_port: int) -> list[str]:
        assert (host, asked_port) == (NAME, port)
        if answers[-1] is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return answers[-1]

    peers = Peers(f"dns:///{NAME}:{port}", lookup=lookup)
    try:
        assert await peers.pause(()) == 2
        assert all(server.router.generation.paused for server in servers)
        assert await peers.abort(["nobody"], ()) == []
        # 127.0.0.2's Pod is replaced: the name no longer has it, its channel goes.
        answers.append(["127.0.0.1"])
        assert await peers.resume(()) == 1
        assert [s.router.generation.paused for s in servers] == [False, True]
        assert peers.dialled == [f"127.0.0.1:{port}"]
        # A name with no address now, or a lookup failing, reaches no one: nothing held.
        answers.append([])
        assert await peers.resume(()) == 0
        answers.append(None)
        assert await peers.pause(()) == 0
        assert [s.router.generation.paused for s in servers] == [False, True]
    finally:
        await peers.close()
