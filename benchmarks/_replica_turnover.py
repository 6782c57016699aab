"""Replicas coming and going under steady load, for benchmarks/scale_out.py.

Stage processes in slots, 127.0.0.1, 127.0.0.2, … all on one port (``Slots``), so
that a slot is listed (``ipv4:``) or named (``dns:``) before its process runs; a
steady load (``SteadyLoad``); and the two measures: how soon a replica
that turns ready gets its first request (``first_request``), and a rolling
replacement of every replica (``rolling``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import grpc

from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from orchestrator.server.stages.resolver import Lookup, system_lookup
from services.mesh.pb.omni.v1.orchestrator_pb2 import REPLICA_READY
from services.mesh.rpc.stage_client import StageClient

WORKERS = 4  # the steady load: clients, each sending its next request as the last ends
SHORT, LONG = 2, 32  # tokens of its answers (one in LONG_EVERY long, while rolling)
LONG_EVERY = 8
POLL_S = 0.01  # ListStages asked this often for a replica's first request


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Slots:
    """Stage processes by slot: slot k listens on 127.0.0.k, every one on ``port``."""

    def __init__(self, config: Path, port: int) -> None:
        self.config = config
        self.port = port
        self._processes: dict[int, StageProcess] = {}

    def address(self, slot: int) -> str:
        return f"127.0.0.{slot}:{self.port}"

    async def start(self, slot: int) -> float:
        """Start slot ``slot``; when it said READY (its InitStatus event's wall time,
        time.time(): on this machine, the stage's clock is ours)."""
        process = StageProcess(self.config, host=f"127.0.0.{slot}", port=self.port)
        self._processes[slot] = process
        address = await process.start(timeout_s=300)
        give_up = time.monotonic() + 300
        async with StageClient(address) as client:
            while True:
                try:
                    events = await client.wait_ready(timeout_s=300)
                    return events[-1].wall_time.ToNanoseconds() / 1e9
                except grpc.aio.AioRpcError:
                    # gRPC shares connections between the channels of a process: the
                    # orchestrator's, to a slot listed before it ran, may be backing
                    # off (up to 1 s) and this call then fails at once.
                    if time.monotonic() > give_up:
                        raise
                    await asyncio.sleep(0.1)

    async def stop(self, slot: int, grace_s: float = 15.0) -> int:
        """SIGTERM: the stage drains (runtime.drain_grace_s) and exits; its exit code."""
        return await self._processes.pop(slot).stop(grace_s)

    async def close(self) -> None:
        processes = list(self._processes.values())
        self._processes.clear()
        await asyncio.gather(*(p.stop(2.0) for p in processes))


class SteadyLoad:
    """``WORKERS`` clients, each sending its next request as its last one ends
    (every ``long_every``-th request ``LONG`` tokens, else ``SHORT``), until
    ``stop()``: as much as the replicas serve, never a queue that grows. How many
    ended well, and what the others ended with."""

    def __init__(self, client: AsyncClient, long_every: int = 0) -> None:
        self._client = client
        self._long_every = long_every
        self._workers: list[asyncio.Task[None]] = []
        self._stopping = False
        self._sent = 0
        self.ok = 0
        self.failed: list[str] = []

    def start(self) -> None:
        self._workers = [asyncio.create_task(self._work()) for _ in range(WORKERS)]

    async def stop(self) -> None:
        """No more new requests; those sent run to their end."""
        self._stopping = True
        await asyncio.gather(*self._workers)

    async def _work(self) -> None:
        while not self._stopping:
            long = self._long_every and self._sent % self._long_every == 0
            self._sent += 1
            await self._one(LONG if long else SHORT)

    async def _one(self, tokens: int) -> None:
        try:
            result = await self._client.generate(
                "Tell me.", params={"max_tokens": tokens}
            ).collect()
        except grpc.aio.AioRpcError as exc:
            self.failed.append(f"{exc.code().name}: {exc.details()}")
            return
        if result.ok:
            self.ok += 1
        else:
            done = result.done
            self.failed.append(f"{done.code_name}: {done.message}" if done else "no Done")


def pipeline(address: str) -> Any:
    stage = {"name": "solo", "address": address}
    return parse_pipeline({"name": "scale", "stages": [stage], "outputs": ["solo"]}, "scale.yaml")


async def replicas(client: AsyncClient) -> dict[str, Any]:
    (stage,) = await client.list_stages()
    return {r.address: r for r in stage.replicas}


async def until_ready(client: AsyncClient, addresses: list[str], timeout_s: float = 60) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        view = await replicas(client)
        if all(a in view and view[a].state == REPLICA_READY for a in addresses):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"replicas {addresses} not all READY within {timeout_s:g}s")


async def first_served(client: AsyncClient, address: str, timeout_s: float = 30) -> float:
    """When the orchestrator first gave ``address`` a request (time.time(), as seen
    by asking ListStages every ``POLL_S``); NaN if not within ``timeout_s``."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        replica = (await replicas(client)).get(address)
        if replica is not None and replica.served:
            return time.time()
        await asyncio.sleep(POLL_S)
    return float("nan")


async def orchestrated(address: str, lookup: Lookup = system_lookup) -> OrchestratorServer:
    server = OrchestratorServer(pipeline(address), lookup=lookup)
    await server.start("127.0.0.1", 0)
    return server


async def first_request(slots: Slots, target: str) -> dict[str, Any]:
    """Slots 1 and 2 serve a steady load; slot 3 starts: seconds from its READY
    (its InitStatus) to its first request. ``target``: ``ipv4`` lists slot 3 from
    the start (not answering yet); ``dns`` is a name whose answer (this
    benchmark's lookup) lists slot 3 once it is ready, as a headless Service
    lists a Pod once Ready, looked up again every ``resolve_s`` (1 s)."""
    listed = [1, 2]

    async def lookup(host: str, port: int) -> list[str]:
        return [f"127.0.0.{slot}" for slot in listed]

    if target == "ipv4":
        address = "ipv4:" + ",".join(slots.address(slot) for slot in (1, 2, 3))
    else:  # the stage's monitor dials the name too: localhost is slot 1
        address = f"dns:///localhost:{slots.port}"
    server = await orchestrated(address, lookup)
    try:
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:
            await client.wait_ready(timeout_s=600)
            await until_ready(client, [slots.address(1), slots.address(2)])
            load = SteadyLoad(client)
            load.start()
            try:
                await asyncio.sleep(1.0)  # steady before the new replica comes
                ready_at = await slots.start(3)
                listed.append(3)
                first_at = await first_served(client, slots.address(3))
            finally:
                await load.stop()
            await slots.stop(3)
    finally:
        await server.stop(1.0)
    return {
        "target": target,
        "ready_to_first_request_s": first_at - ready_at,
        "served": load.ok,
        "failed": len(load.failed),
        "failures": load.failed[:5],
    }


async def rolling(slots: Slots, old: list[int], new: list[int]) -> dict[str, Any]:
    """Slots ``old`` serve a steady load (one answer in ``LONG_EVERY`` long, so a
    replica holds some when told to stop); each is replaced in turn as a rolling
    update does: its successor in ``new`` started and READY, then the old one sent
    SIGTERM (it drains) and waited out. Every slot is listed (``ipv4:``) throughout."""
    address = "ipv4:" + ",".join(slots.address(slot) for slot in sorted(old + new))
    server = await orchestrated(address)
    exits = []
    try:
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:
            await client.wait_ready(timeout_s=600)
            await until_ready(client, [slots.address(slot) for slot in old])
            load = SteadyLoad(client, long_every=LONG_EVERY)
            load.start()
            began = time.monotonic()
            try:
                for gone, coming in zip(old, new, strict=True):
                    await slots.start(coming)
                    exits.append(await slots.stop(gone))
            finally:
                await load.stop()
            took = time.monotonic() - began
            served = {a: r.served for a, r in (await replicas(client)).items()}
    finally:
        await server.stop(1.0)
    return {
        "replaced": len(old),
        "served": load.ok,
        "failed": len(load.failed),
        "failures": load.failed[:5],
        "seconds": took,
        "exit_codes": exits,
        "per_replica": served,
    }
