"""Stage replicas: one stage address naming two real stage processes spreads requests
over both, and when one replica dies later requests are served by the other.

In a cluster the address is ``dns:///<headless Service>:<port>`` (every ready and
starting Pod's address); here it is an ``ipv4:`` target with the two replicas on
127.0.0.1 and 127.0.0.2 at one port (all of 127/8 is loopback), the same list of
addresses a DNS answer would give. The replicas differ only in their default
``max_tokens`` (2 and 3), so the receiving side can tell which one served a request.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import grpc
import pytest

from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.stage import server as stage_server
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config, write_config
from tests.helpers.lock_holder import lock_held
from tests.orchestrator.conftest import orchestrator

REPLICA_HOSTS = ("127.0.0.1", "127.0.0.2")
TOKENS = {"127.0.0.1": 2, "127.0.0.2": 3}  # each replica's default max_tokens
REQUESTS = 8


async def start_replicas(
    tmp_path: Path, cache: Path, *, second_locked: Path | None = None
) -> tuple[list[StageProcess], str]:
    """Two replicas of stage "solo" at one port; returns them and the target naming both.
    With ``second_locked`` the second one waits for the device lock in that folder
    (alive, not ready) and is not waited for."""
    replicas: list[StageProcess] = []
    port = 0
    try:
        for host in REPLICA_HOSTS:
            runtime: dict[str, object] = {"torch_threads": 1}
            if second_locked is not None and replicas:
                runtime.update(device_lock=True, lock_dir=str(second_locked))
            config = tiny_config(
                "solo",
                cache,
                defaults={"temperature": 0.0, "max_tokens": TOKENS[host]},
                runtime=runtime,
            )
            path = write_config(tmp_path / f"solo-{host}.yaml", config)
            replica = StageProcess(path, host=host, port=port)
            replicas.append(replica)
            await replica.start()
            port = replica.port  # the second replica binds the first one's port
        for replica in replicas[: 1 if second_locked else None]:
            async with StageClient(replica.address) as client:
                await client.wait_ready(timeout_s=180)
    except BaseException:
        for replica in replicas:
            await replica.stop(1)
        raise
    return replicas, "ipv4:" + ",".join(f"{host}:{port}" for host in REPLICA_HOSTS)


def served_by(token_count: int) -> str:
    hosts = [host for host, tokens in TOKENS.items() if tokens == token_count]
    assert hosts, f"{token_count} tokens: no replica answers with that many"
    return hosts[0]


async def test_stage_client_spreads_requests_and_fails_over(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    replicas, target = await start_replicas(tmp_path, omni_cache_dir)
    try:
        async with StageClient(target) as client:
            counts: collections.Counter[str] = collections.Counter()
            for i in range(REQUESTS):
                outputs = [o async for o in client.generate(chat_submit(f"r{i}", "Hello"))]
                completed = outputs[-1].completed
                assert completed.request_id == f"r{i}", outputs[-1]
                tokens = [t for o in outputs if o.HasField("segment") for t in o.segment.token_ids]
                counts[served_by(len(tokens))] += 1
            # round_robin alternates once both connections are up; the first call
            # may come before the second replica's connection is ready.
            assert counts["127.0.0.1"] >= REQUESTS // 2 - 1, counts
            assert counts["127.0.0.2"] >= REQUESTS // 2 - 1, counts

            replicas[1]._proc.kill()  # type: ignore[union-attr]  # gone, no drain
            await replicas[1].wait()
            after: collections.Counter[str] = collections.Counter()
            for i in range(REQUESTS):
                outputs = [o async for o in client.generate(chat_submit(f"k{i}", "Hello"))]
                assert outputs[-1].HasField("completed"), outputs[-1]
                tokens = [t for o in outputs if o.HasField("segment") for t in o.segment.token_ids]
                after[served_by(len(tokens))] += 1
            assert after == {"127.0.0.1": REQUESTS}, after
    finally:
        for replica in replicas:
            await replica.stop(1)


async def test_orchestrator_routes_over_replicas_and_survives_losing_one(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    replicas, target = await start_replicas(tmp_path, omni_cache_dir)
    pipeline = parse_pipeline(
        {"name": "replicas", "stages": [{"name": "solo", "address": target}]}, "replicas.yaml"
    )
    try:
        async with orchestrator(pipeline) as (_server, client):
            counts: collections.Counter[str] = collections.Counter()
            for _ in range(REQUESTS):
                result = await client.generate("Hello").collect()
                assert result.ok, result.done
                counts[served_by(len(result.stages["solo"].token_ids))] += 1
            assert counts["127.0.0.1"] >= REQUESTS // 2 - 1, counts
            assert counts["127.0.0.2"] >= REQUESTS // 2 - 1, counts

            replicas[1]._proc.kill()  # type: ignore[union-attr]
            await replicas[1].wait()
            # The monitor may see the loss (a health check that picked the dead
            # replica) and go DOWN for a moment; it is READY again over the survivor.
            await client.wait_ready(timeout_s=30)
            after: collections.Counter[str] = collections.Counter()
            for _ in range(REQUESTS):
                result = await client.generate("Hello").collect()
                assert result.ok, result.done
                after[served_by(len(result.stages["solo"].token_ids))] += 1
            assert after == {"127.0.0.1": REQUESTS}, after
    finally:
        for replica in replicas:
            await replica.stop(1)


async def test_a_replica_that_is_not_ready_gets_no_requests(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    locks = tmp_path / "locks"
    locks.mkdir()
    async with lock_held(locks):
        replicas, target = await start_replicas(tmp_path, omni_cache_dir, second_locked=locks)
        pipeline = parse_pipeline(
            {"name": "replicas", "stages": [{"name": "solo", "address": target}]},
            "replicas.yaml",
        )
        server = OrchestratorServer(pipeline)
        try:
            port = await server.start("127.0.0.1", 0)
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                # Today the monitor may follow the waiting replica's InitStatus: then
                # the stage is STARTING though the other replica serves.
                await client.wait_ready(timeout_s=15)
                for _ in range(REQUESTS):
                    result = await client.generate("Hello").collect()
                    assert result.ok, result.done
                    assert served_by(len(result.stages["solo"].token_ids)) == "127.0.0.1"
        finally:
            await server.stop(1.0)
            for replica in replicas:
                await replica.stop(1)


async def test_connections_age_out_but_streams_live_on(
    monkeypatch: pytest.MonkeyPatch, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    """A stage sends GOAWAY to old connections, so a client dialling replicas by DNS
    resolves again (and finds replicas added since); a stream open then runs on."""
    monkeypatch.setattr(stage_server, "MAX_CONNECTION_AGE_MS", 500)
    config = tiny_config("solo", omni_cache_dir, runtime={"torch_threads": 1})
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=120)
            call = client.open_stream()
            assert await asyncio.wait_for(ask(call, "before"), 30) == 2
            # Past the age: the connection has had its GOAWAY, this stream goes on.
            await asyncio.sleep(1.5)
            assert await asyncio.wait_for(ask(call, "after"), 30) == 2
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            # The aged connection is closed by the server and taken again (round_robin
            # reconnects at once); without a maximum age it would stay READY.
            assert client.channel.get_state() == grpc.ChannelConnectivity.READY
            await asyncio.wait_for(
                client.channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 5
            )
            assert (await client.describe()).name == "solo"
    finally:
        await server.stop(1.0)


async def ask(call: grpc.aio.StreamStreamCall, request_id: str) -> int:
    """One request on an open Generate stream; the number of tokens it came back with."""
    await call.write(stage_pb2.StageInput(submit=chat_submit(request_id, "Hello", max_tokens=2)))
    tokens = 0
    while (output := await call.read()) is not grpc.aio.EOF:
        kind = output.WhichOneof("kind")
        assert kind in ("segment", "completed"), output
        if kind == "segment":
            tokens += len(output.segment.token_ids)
        else:
            assert output.completed.request_id == request_id
            return tokens
    raise AssertionError(f"the stream ended before {request_id} completed")
