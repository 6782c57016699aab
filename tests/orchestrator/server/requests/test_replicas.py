"""Every replica of a stage serves, one by one: a stage address naming several
(an ``ipv4:`` list, a ``dns:`` name looked up again) gets a stream per replica,
a new request goes to the least busy READY one, and a replica that dies fails
only what it held (naming itself) while a request it had not started moves on.
The replicas are real stage servers on distinct loopback addresses; the engine
is the scripted one ("hold": one token, then nothing until cancelled)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.stages.replica import READY
from orchestrator.server.stages.replicas import ReplicaSet, ReplicaSettings
from orchestrator.server.stages.resolver import Target
from services.engines.base import EngineEvent, EnginePlan
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from tests.helpers.engines import ScriptedEngine
from tests.helpers.polling import eventually
from tests.helpers.ports import shared_port
from tests.orchestrator.conftest import orchestrator


class QuietEngine(ScriptedEngine):
    """The scripted engine, and "quiet": nothing at all until cancelled while
    ``quiet`` (a request queued, not started), else as any prompt."""

    quiet: ClassVar[bool] = os.environ.get("OMNI_TEST_QUIET") == "1"

    async def generate(self, plan: EnginePlan) -> AsyncGenerator[EngineEvent, None]:
        if plan.request.text == "quiet" or plan.request.messages[-1][1] == "quiet":
            if QuietEngine.quiet:
                await asyncio.Event().wait()
        async for event in super().generate(plan):
            yield event


def scripted(cache_dir: Path) -> dict[str, object]:
    return {
        "name": "solo",
        "engine": f"{__name__}:QuietEngine",
        "load_format": "dummy",
        "cache_dir": str(cache_dir),
        "defaults": {"max_tokens": 3},
        "runtime": {"torch_threads": 1, "max_batch_size": 8, "max_queue_size": 16},
    }


@asynccontextmanager
async def replicas(
    cache_dir: Path, count: int, port: int = 0, host: int = 1
) -> AsyncIterator[dict[str, StageServer]]:
    """``count`` replicas on 127.0.0.``host``, the next, …, by address (``port``: all on it)."""
    servers: dict[str, StageServer] = {}
    try:
        for index in range(count):
            server = StageServer(parse_stage_config(scripted(cache_dir)))
            ip = f"127.0.0.{host + index}"
            address = f"{ip}:{await server.start(ip, port)}"
            servers[address] = server
            async with StageClient(address) as client:
                await client.wait_ready(timeout_s=60)
        yield servers
    finally:
        await asyncio.gather(*(s.stop(0.5) for s in servers.values()))


def solo(address: str, routing: str = "least_outstanding", affinity: bool = False):
    stage = {"name": "solo", "address": address, "routing": routing, "affinity": affinity}
    return parse_pipeline({"name": "solo", "stages": [stage], "outputs": ["solo"]}, "p.yaml")


def ipv4(servers: dict[str, StageServer]) -> str:
    return "ipv4:" + ",".join(servers)


async def replica_view(client: AsyncClient) -> dict[str, orchestrator_pb2.ReplicaStatus]:
    (stage,) = await client.list_stages()
    return {r.address: r for r in stage.replicas}


async def all_ready(client: AsyncClient, count: int) -> None:
    async def ready() -> bool:
        view = await replica_view(client)
        return len(view) == count and all(r.state == READY for r in view.values())

    await eventually(ready, 10, message="replicas not all READY")


def test_a_target_names_its_replicas() -> None:
    assert Target.parse("127.0.0.1:5000").fixed == ("127.0.0.1:5000",)
    assert Target.parse("ipv4:127.0.0.1:5000,127.0.0.2:5000").fixed == (
        "127.0.0.1:5000",
        "127.0.0.2:5000",
    )
    dns = Target.parse("dns:///omni-thinker.ns.svc.cluster.local:50051")
    assert (dns.host, dns.port, dns.fixed) == ("omni-thinker.ns.svc.cluster.local", 50051, ())
    assert Target.parse("dns:omni:7").host == "omni"
    with pytest.raises(ValueError, match="dns:name:port"):
        Target.parse("dns:///omni")


async def test_every_replica_serves_and_each_is_listed(omni_cache_dir: Path) -> None:
    async with replicas(omni_cache_dir, 4) as servers:
        async with orchestrator(solo(ipv4(servers))) as (_server, client):
            await all_ready(client, 4)
            results = await asyncio.gather(*(client.generate("Hi").collect() for _ in range(16)))
            assert all(r.ok for r in results), [r.done for r in results]
            view = await replica_view(client)
        # What each replica itself saw: every one served, none all.
        seen = {address: len(s.engine.released) for address, s in servers.items()}
        assert all(seen.values()) and sum(seen.values()) == 16, seen
        assert {a: r.served for a, r in view.items()} == seen
        assert all(r.in_flight == 0 and r.queued == 0 for r in view.values())


@pytest.mark.parametrize(
    ("routing", "holds"), [("least_outstanding", [2, 2]), ("round_robin", [0, 4])]
)
async def test_least_outstanding_routing_spreads_long_requests(
    omni_cache_dir: Path, routing: str, holds: list[int]
) -> None:
    """Long and short requests in turn: dealt in turn, every long one lands on
    one replica; by room, each new long one goes where the others are not."""
    async with replicas(omni_cache_dir, 2) as servers:
        async with orchestrator(solo(ipv4(servers), routing)) as (server, client):
            await all_ready(client, 2)
            held = []
            for index in range(4):
                held.append(client.generate("hold", request_id=f"long{index}"))
                await eventually(lambda n=index + 1: server.router.in_flight == n, 5)
                short = await client.generate("Hi").collect()
                assert short.ok, short.done
            view = await replica_view(client)
            assert sorted(r.in_flight for r in view.values()) == holds
            await client.abort(*(f"long{index}" for index in range(4)))
            for stream in held:
                await stream.collect()


async def test_a_request_that_has_run_long_weighs_more_than_one_just_begun(
    omni_cache_dir: Path,
) -> None:
    """Replica a holds one answer 64 tokens long and going on; b holds two that
    have said one token each. Counted by requests, a has room (1 < 2); counted
    by work, the long answer is worth four (``LONG_AFTER``): the next request
    goes to b, and each replica's engine says which it ran."""
    async with replicas(omni_cache_dir, 2) as servers:
        async with orchestrator(solo(ipv4(servers))) as (server, client):
            await all_ready(client, 2)
            long = client.generate("hold 64", request_id="long").__aiter__()
            tokens = 0
            while tokens < 64:
                event = await long.__anext__()
                tokens += len(event.segment.token_ids)
            held = [client.generate("hold", request_id=f"held{n}") for n in range(2)]
            await eventually(lambda: server.router.in_flight == 3, 5)
            view = await replica_view(client)
            (a,) = [address for address, r in view.items() if r.in_flight == 1]
            (b,) = [address for address, r in view.items() if r.in_flight == 2]
            short = await client.generate("Hi", request_id="short").collect()
            assert short.ok, short.done
            await client.abort("long", "held0", "held1")
            await asyncio.gather(*(stream.collect() for stream in held))
            async for _event in long:
                pass
        assert any(r.endswith("-short") for r in servers[b].engine.released)
        assert not any(r.endswith("-short") for r in servers[a].engine.released)


@pytest.mark.parametrize("affinity", [True, False])
async def test_a_conversation_stays_on_its_replica_on_a_stage_with_affinity(
    omni_cache_dir: Path, affinity: bool
) -> None:
    """A conversation's first turn lands on a replica that a long request then
    keeps busy, while the other is idle: by room the next turn goes to the other
    one; with affinity it stays. (A long request first holds one replica, so the
    turn lands on the other; a second long request follows the room there; the
    first is then aborted.)"""
    async with replicas(omni_cache_dir, 2) as servers:
        config = solo(ipv4(servers), affinity=affinity)
        async with orchestrator(config) as (server, client):
            await all_ready(client, 2)
            elsewhere = client.generate("hold", request_id="elsewhere")
            await eventually(lambda: server.router.in_flight == 1, 5)
            first = await client.generate("Hi", request_id="turn-0", affinity_key="chat").collect()
            held = client.generate("hold", request_id="long")
            await eventually(lambda: server.router.in_flight == 2, 5)
            await client.abort("elsewhere")
            await elsewhere.collect()
            await eventually(lambda: server.router.in_flight == 1, 5)
            second = await client.generate("Hi", request_id="turn-1", affinity_key="chat").collect()
            assert first.ok and second.ok, (first.done, second.done)
            view = await replica_view(client)
            await client.abort("long")
            await held.collect()

        def where(rid: str) -> str:
            (address,) = [a for a, s in servers.items() if any(rid in r for r in s.engine.released)]
            return address

        busy = [a for a, r in view.items() if r.in_flight == 1]
        assert busy == [where("turn-0")]  # the long request went where the turn had been
        assert (where("turn-1") == where("turn-0")) == affinity


async def test_a_dead_replica_fails_only_what_it_held_and_a_request_it_had_not_started_moves(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    """Replica a is a process, killed (no drain: simply gone) while it holds a
    request it answered ("hold") and one it said nothing of ("quiet")."""
    config = tmp_path / "solo.yaml"
    config.write_text(yaml.safe_dump(scripted(omni_cache_dir)))
    killed = StageProcess(config, host="127.0.0.1", env={**os.environ, "OMNI_TEST_QUIET": "1"})
    a = await killed.start()
    try:
        async with replicas(omni_cache_dir, 1, host=2) as servers:
            (b,) = servers
            address = f"ipv4:{a},{b}"
            async with orchestrator(solo(address, "round_robin")) as (server, client):
                await all_ready(client, 2)
                first = client.generate("hold", request_id="on-a")  # in turn: a, b, a
                await eventually(lambda: server.router.in_flight == 1, 5)
                second = client.generate("hold", request_id="on-b")
                await eventually(lambda: server.router.in_flight == 2, 5)
                quiet = client.generate("quiet", request_id="quiet-on-a")

                async def quiet_on_a() -> bool:
                    return (await replica_view(client))[a].queued == 1

                await eventually(quiet_on_a, 5, message="never sent to a")
                killed._proc.kill()  # type: ignore[union-attr]  # no drain: simply gone
                lost = await first.collect()
                assert lost.done.code_name == "UNAVAILABLE" and a in lost.done.message, lost.done
                moved = await quiet.collect()  # b runs it: only a's engine is quiet
                assert moved.ok, moved.done
                assert any(r.endswith("quiet-on-a") for r in servers[b].engine.released)
                # b's long request went on throughout.
                assert server.router.stage_id("on-b") is not None
                await client.abort("on-b")
                assert (await second.collect()).done.code_name == "CANCELLED"

                # a new request now goes to b, or to a before its health says DOWN
                # (its stream waits for a connection): there it moves to b then.
                again = await asyncio.wait_for(client.generate("Hi").collect(), 15)
                assert again.ok, again.done
    finally:
        await killed.stop(1.0)


async def test_a_replica_holding_another_clients_requests_gets_no_new_one(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    """Replica a, listed first, holds two long requests of another client (a second
    orchestrator, say): it says so (Load) and ListStages shows it; this orchestrator,
    which has nothing on either replica, sends its requests to b. Both are processes."""
    config = tmp_path / "solo.yaml"
    config.write_text(yaml.safe_dump(scripted(omni_cache_dir)))
    processes = [StageProcess(config, host=f"127.0.0.{host}") for host in (1, 2)]
    try:
        a, b = [await process.start() for process in processes]
        async with StageClient(a) as other:
            await other.wait_ready(timeout_s=60)
            held = [other.generate(chat_submit(f"other-{i}", "hold")) for i in range(2)]
            for stream in held:  # its one token: running there
                assert (await anext(stream)).WhichOneof("kind") == "segment"
            async with orchestrator(solo(f"ipv4:{a},{b}")) as (_server, client):
                await all_ready(client, 2)

                async def a_says_two() -> bool:
                    return (await replica_view(client))[a].held == 2

                await eventually(a_says_two, 10, message="a's load never shown")
                results = [await client.generate("Hi").collect() for _ in range(4)]
                assert all(r.ok for r in results), [r.done for r in results]
                view = await replica_view(client)
            for stream in held:
                await stream.aclose()
        assert (view[a].served, view[b].served) == (0, 4)
        assert (view[a].in_flight, view[b].held) == (0, 0)
    finally:
        await asyncio.gather(*(process.stop(1.0) for process in processes))


async def test_a_dns_name_is_looked_up_again_and_replicas_come_and_go(
    omni_cache_dir: Path,
) -> None:
    answers = [["127.0.0.1"]]

    async def lookup(host: str, port: int) -> list[str]:
        assert host == "omni-solo.test"
        return answers[-1]

    port = shared_port()  # its replicas are on 127.0.0.1 and 127.0.0.2
    async with replicas(omni_cache_dir, 2, port=port):
        settings = ReplicaSettings(resolve_s=0.05, health_poll_s=0.05)
        found = ReplicaSet(
            "solo", f"dns:///omni-solo.test:{port}", settings=settings, lookup=lookup
        )
        await found.start()
        try:

            def ready() -> list[str]:
                return sorted(a for a, r in found.replicas.items() if r.state == READY)

            await eventually(lambda: ready() == [f"127.0.0.1:{port}"], 5)
            answers.append(["127.0.0.1", "127.0.0.2"])
            await eventually(lambda: len(ready()) == 2, 5, message="a new replica not found")
            answers.append(["127.0.0.2"])
            await eventually(lambda: ready() == [f"127.0.0.2:{port}"], 5, message="never left")
            assert (await found.pick()).address == f"127.0.0.2:{port}"
        finally:
            await found.stop()
