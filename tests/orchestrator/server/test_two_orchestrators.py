"""Issue 39, item 5: two orchestrator processes over one real stage process, each
told of the other (``--peers``, itself listed too, as a headless Service lists
every Pod). A call behaves the same whichever orchestrator it lands on: an Abort
sent to B stops A's request, a Pause sent to B holds A's new requests and a
Resume sent to B lets them go. Killing A fails only A's requests; a client given
both keeps working on B."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from orchestrator.cli.processes import GatewayProcess, OrchestratorProcess
from orchestrator.client import AsyncClient, Result
from services.mesh.pb.externalscaler import externalscaler_pb2 as pb
from services.mesh.pb.externalscaler.externalscaler_pb2_grpc import ExternalScalerStub
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.testing.configs import tiny_config
from tests.helpers.polling import eventually
from tests.helpers.ports import free_port
from tests.orchestrator.conftest import Stages

LONG = {"max_tokens": 5000}  # runs until stopped, on this tiny model (seconds at least)
SHORT = {"max_tokens": 3}
# A call marked as passed on is acted on where it lands alone: pausing A only.
ALONE = (("omni-forwarded-by", "the-test"),)


@pytest.fixture(scope="module")
async def stage(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[str]:
    stages = Stages(tmp_path_factory.mktemp("stage"))
    runtime = {"torch_threads": 1, "max_batch_size": 4, "max_queue_size": 16}
    try:
        await stages.start({"thinker": tiny_config("thinker", omni_cache_dir, runtime=runtime)})
        yield stages.addresses["thinker"]
    finally:
        await stages.stop()


class Pair:
    """Orchestrators A and B over ``stage``, each with a client of its own."""

    def __init__(self, a: OrchestratorProcess, b: OrchestratorProcess) -> None:
        self.a, self.b = a, b
        self.to_a = AsyncClient(a.address)
        self.to_b = AsyncClient(b.address)

    @property
    def both(self) -> str:
        return f"{self.a.address},{self.b.address}"

    async def close(self) -> None:
        await self.to_a.close()
        await self.to_b.close()


@pytest.fixture
async def pair(stage: str, tmp_path: Path) -> AsyncIterator[Pair]:
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        yaml.safe_dump({"name": "peers", "stages": [{"name": "thinker", "address": stage}]})
    )
    ports = [free_port(), free_port()]
    peers = ["--peers", "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)]
    processes = [OrchestratorProcess(pipeline, port=p, args=peers) for p in ports]
    async with AsyncExitStack() as stack:
        for process in processes:
            stack.push_async_callback(process.stop, 2.0)
            await process.start()
        found = Pair(*processes)
        stack.push_async_callback(found.close)
        await asyncio.gather(found.to_a.wait_ready(60), found.to_b.wait_ready(60))
        yield found


async def started(
    client: AsyncClient, request_id: str
) -> tuple[AsyncIterator[orchestrator_pb2.GenerateEvent], Result]:
    """A long request on ``client``'s orchestrator, once its first event is in."""
    events = aiter(client.generate("Tell a long story.", request_id=request_id, params=LONG))
    result = Result()
    result.add(await asyncio.wait_for(anext(events), 30))
    assert result.stages, result.done
    return events, result


async def rest(events: AsyncIterator[orchestrator_pb2.GenerateEvent], result: Result) -> Result:
    async for event in events:
        result.add(event)
    return result


async def in_flight(client: AsyncClient) -> int:
    """Requests ``client``'s orchestrator has on the stage now."""
    (stage,) = await client.list_stages()
    return sum(r.in_flight for r in stage.replicas)


async def idle(client: AsyncClient) -> bool:
    return await in_flight(client) == 0


async def busy(client: AsyncClient) -> bool:
    return await in_flight(client) > 0


async def test_abort_sent_to_b_stops_a_request_held_by_a(pair: Pair) -> None:
    events, result = await started(pair.to_a, "held-by-a")
    reply = await pair.to_b.abort("held-by-a", "held-by-nobody")
    assert list(reply.aborted) == ["held-by-a"]
    assert list(reply.not_found) == ["held-by-nobody"]
    done = (await asyncio.wait_for(rest(events, result), 30)).done
    assert done is not None and done.code_name == "CANCELLED" and done.request_id == "held-by-a"
    # A holds nothing on the stage any more, and the stage takes the next request.
    await eventually(lambda: idle(pair.to_a), 10)
    after = await asyncio.wait_for(pair.to_b.generate("Hi", params=SHORT).collect(), 30)
    assert after.ok, after.done
    # Sent to A itself, the Abort is answered there (B is not asked for what A holds).
    events, result = await started(pair.to_a, "held-by-a-2")
    assert list((await pair.to_a.abort("held-by-a-2")).aborted) == ["held-by-a-2"]
    done = (await asyncio.wait_for(rest(events, result), 30)).done
    assert done is not None and done.code_name == "CANCELLED"


async def test_pause_sent_to_b_holds_a_and_resume_sent_to_b_releases_it(pair: Pair) -> None:
    await pair.to_b.pause()
    held = asyncio.create_task(pair.to_a.generate("Hi", params=SHORT).collect())
    held_on_b = asyncio.create_task(pair.to_b.generate("Hi", params=SHORT).collect())
    done, _pending = await asyncio.wait({held, held_on_b}, timeout=1.5)
    assert not done, "a request started while every orchestrator was paused"
    await pair.to_b.resume()
    for answer in await asyncio.wait_for(asyncio.gather(held, held_on_b), 30):
        assert answer.ok, answer.done
    # Paused through A, resumed through B: the same.
    await pair.to_a.pause()
    held = asyncio.create_task(pair.to_b.generate("Hi", params=SHORT).collect())
    await asyncio.sleep(1.0)
    assert not held.done()
    await pair.to_b.resume()
    answer = await asyncio.wait_for(held, 30)
    assert answer.ok, answer.done


async def test_a_stopping_orchestrator_hands_what_it_had_not_started_to_the_other(
    pair: Pair,
) -> None:
    """SIGTERM (a rolling update, a drain): A fails what it carried, and a request it
    had taken but not started ends with UNAVAILABLE alone, the server going away,
    so the client tries it on B; no Done of A's reaches that client."""
    async with AsyncClient(pair.both) as either:
        for _ in range(2):  # connected to both (round_robin deals only to those connected)
            assert (await asyncio.wait_for(either.generate("Hi", params=SHORT).collect(), 30)).ok
        carried, carried_result = await started(pair.to_a, "carried")
        await pair.to_a.stub.PauseGeneration(
            orchestrator_pb2.PauseGenerationRequest(), metadata=ALONE
        )
        held = [
            asyncio.create_task(either.generate("Hi", params=SHORT).collect()) for _ in range(4)
        ]
        # Dealt in turn: B answers its share, A holds the rest (paused).
        await eventually(lambda: sum(t.done() for t in held) >= 2, 30)
        assert not all(t.done() for t in held)
        stopping = asyncio.create_task(pair.a.stop(5.0))
        done = (await asyncio.wait_for(rest(carried, carried_result), 30)).done
        assert done is not None and done.code_name == "UNAVAILABLE", done
        for answer in await asyncio.wait_for(asyncio.gather(*held), 60):
            assert answer.ok, answer.done
        assert await stopping == 0


async def test_killing_a_fails_only_as_requests_and_a_client_of_both_moves_to_b(
    pair: Pair, tmp_path: Path
) -> None:
    log = (tmp_path / "gateway.log").open("ab")
    gateway = GatewayProcess(pair.both, log=log)
    async with AsyncExitStack() as stack:
        stack.callback(log.close)
        stack.push_async_callback(gateway.stop, 5.0)
        await gateway.start()
        either = await stack.enter_async_context(AsyncClient(pair.both))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
        await _killing_a(pair, either, http, f"http://{gateway.address}/v1/chat/completions")


async def _killing_a(pair: Pair, either: AsyncClient, http: httpx.AsyncClient, chat: str) -> None:
    chat_body = {"model": "peers", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    # Both serve the two-target client: calls are dealt in turn.
    for _ in range(4):
        answer = await asyncio.wait_for(either.generate("Hi", params=SHORT).collect(), 30)
        assert answer.ok, answer.done
    for _ in range(2):
        reply = await http.post(chat, json=chat_body)
        assert reply.status_code == 200, reply.text
    served = [await _served(pair.to_a), await _served(pair.to_b)]
    assert all(n >= 1 for n in served), served
    on_a, a_result = await started(pair.to_a, "on-a")
    # A alone paused (a call marked as passed on is acted on where it lands): the
    # client of both has requests A took but has not started, and so not answered.
    await pair.to_a.stub.PauseGeneration(orchestrator_pb2.PauseGenerationRequest(), metadata=ALONE)
    not_started = [
        asyncio.create_task(either.generate("Hi", params=SHORT).collect()) for _ in range(4)
    ]
    on_b = asyncio.create_task(
        pair.to_b.generate("Tell a story.", request_id="on-b", params={"max_tokens": 400}).collect()
    )
    await eventually(lambda: busy(pair.to_b), 30)
    await pair.a.kill()
    # What A carried fails, UNAVAILABLE (no Done: A is gone)...
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await asyncio.wait_for(rest(on_a, a_result), 30)
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    # ... what B carries finishes, and what A had not answered is tried again on B.
    kept = await asyncio.wait_for(on_b, 60)
    assert kept.ok, kept.done
    for answer in await asyncio.wait_for(asyncio.gather(*not_started), 60):
        assert answer.ok, answer.done
    # New requests of the client of both all go to B (none fails on the dead A),
    # and so do the gateway's (given both too).
    for _ in range(6):
        answer = await asyncio.wait_for(either.generate("Hi", params=SHORT).collect(), 30)
        assert answer.ok, answer.done
        reply = await http.post(chat, json=chat_body)
        assert reply.status_code == 200, reply.text
    # And an Abort or a Pause on B, its peer A gone, still answers at once.
    nobody = await asyncio.wait_for(pair.to_b.abort("nobody"), 10)
    assert list(nobody.not_found) == ["nobody"]
    await asyncio.wait_for(pair.to_b.pause(), 10)
    await asyncio.wait_for(pair.to_b.resume(), 10)


async def _served(client: AsyncClient) -> int:
    (stage,) = await client.list_stages()
    return sum(r.served for r in stage.replicas)


async def test_kedas_metric_from_either_orchestrator_counts_both(pair: Pair) -> None:
    """KEDA asks whichever orchestrator the Service picks: the stage's demand it is
    told must count the requests every orchestrator carries, not the one asked."""
    ref = pb.ScaledObjectRef(name="thinker", namespace="omni", scalerMetadata={"stage": "thinker"})
    channels = [grpc.aio.insecure_channel(p.address) for p in (pair.a, pair.b)]
    to_a, to_b = (ExternalScalerStub(c) for c in channels)
    try:
        asked = pb.GetMetricsRequest(scaledObjectRef=ref)

        async def metric(
            stub: ExternalScalerStub, metadata: tuple[tuple[str, str], ...] = ()
        ) -> float:
            reply = await stub.GetMetrics(asked, metadata=metadata)
            return float(reply.metricValues[0].metricValueFloat)

        events, result = await started(pair.to_a, "counted")
        assert await metric(to_b) == 1.0  # B holds none of it: A's, through its peers
        assert await metric(to_a) == 1.0  # A's own, and B's none: not twice
        assert await metric(to_b, ALONE) == 0.0  # passed on: B's alone
        assert (await to_b.IsActive(ref)).result
        await pair.to_a.abort("counted")
        await asyncio.wait_for(rest(events, result), 30)
        await eventually(lambda: _zero(metric(to_b)), 10)
        assert not (await to_b.IsActive(ref)).result
    finally:
        for channel in channels:
            await channel.close()


async def _zero(value: Awaitable[float]) -> bool:
    return await value == 0.0
