"""KEDA's external scaler, served by a real orchestrator over a real stage, called
as KEDA's own scaler calls it (the generated externalscaler stubs on a plain
channel, the trigger's metadata in scalerMetadata): the metric is the stage's
requests waiting and in flight, IsActive and StreamIsActive follow it, bad
metadata is refused naming the key. The stage is the scripted engine ("hold":
one token, then nothing until aborted) on a port that serves nothing at first,
so requests first wait for it, as for a stage scaled to zero."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.pb.externalscaler import externalscaler_pb2 as pb
from services.mesh.pb.externalscaler import externalscaler_pb2_grpc
from services.mesh.security import SecuritySettings
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from tests.helpers.grpcurl import grpcurl
from tests.helpers.polling import eventually
from tests.helpers.ports import free_port
from tests.orchestrator.server.requests.test_replicas import scripted

METRIC = "omni-solo-requests"


def pipeline(stage_port: int) -> Any:
    stage = {"name": "solo", "address": f"127.0.0.1:{stage_port}", "init_timeout_s": 120}
    # Requests wait up to ready_wait_s for a stage that is not READY: long enough here.
    runtime = {"ready_wait_s": 60}
    config = {"name": "solo", "stages": [stage], "outputs": ["solo"], "runtime": runtime}
    return parse_pipeline(config, "p.yaml")


@asynccontextmanager
async def replica_on(port: int, cache_dir: Path) -> AsyncIterator[StageServer]:
    """A replica of the stage, come up on ``port`` (not waited for here: the
    orchestrator's channels to it, in backoff, are what must find it)."""
    server = StageServer(parse_stage_config(scripted(cache_dir)))
    await server.start("127.0.0.1", port)
    try:
        yield server
    finally:
        await server.stop(0.5)


@pytest.fixture(scope="module")
async def stage_port(omni_cache_dir: Path) -> AsyncIterator[int]:
    """A replica of the stage for the tests that need it up throughout."""
    port = free_port()
    async with replica_on(port, omni_cache_dir):
        yield port


@asynccontextmanager
async def scaler_over(
    stage_port: int, security: SecuritySettings | None = None, *, ready: bool = True
) -> AsyncIterator[tuple[OrchestratorServer, externalscaler_pb2_grpc.ExternalScalerStub, str]]:
    """An orchestrator (``ready``: once its stage is READY) and a stub for its
    external scaler, as KEDA dials it: plaintext, no token. Stopped with its stage
    READY: stopping a StageMonitor while its stage is STARTING hung in its countdown
    ticker's wait_for here, 3 times in about 25 runs (Python 3.11)."""
    server = OrchestratorServer(pipeline(stage_port), security=security)
    port = await server.start("127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    try:
        if ready:
            await eventually(lambda: server.monitors["solo"].ready, 30, message="stage not READY")
        async with grpc.aio.insecure_channel(address) as channel:
            yield server, externalscaler_pb2_grpc.ExternalScalerStub(channel), address
    finally:
        await server.stop(1.0)


def ref(**metadata: str) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name="omni-solo", namespace="omni", scalerMetadata=metadata)


async def metric(scaler: externalscaler_pb2_grpc.ExternalScalerStub, trigger: Any) -> float:
    reply = await scaler.GetMetrics(
        pb.GetMetricsRequest(scaledObjectRef=trigger, metricName=METRIC)
    )
    (value,) = reply.metricValues
    assert value.metricName == METRIC and value.metricValue == value.metricValueFloat
    return value.metricValueFloat


async def test_the_metric_counts_requests_waiting_then_in_flight_and_falls_back_to_zero(
    omni_cache_dir: Path,
) -> None:
    stage_port = free_port()  # nothing serves there yet: as a stage scaled to zero
    later = contextlib.AsyncExitStack()
    async with later, scaler_over(stage_port, ready=False) as (server, scaler, address):
        trigger = ref(scalerAddress=address, stage="solo", targetPerReplica="4")
        spec = await scaler.GetMetricSpec(trigger)
        assert list(spec.metricSpecs) == [
            pb.MetricSpec(metricName=METRIC, targetSize=4, targetSizeFloat=4.0)
        ]
        assert await metric(scaler, trigger) == 0
        assert not (await scaler.IsActive(trigger)).result
        pushed = scaler.StreamIsActive(trigger)
        assert (await pushed.read()).result is False  # the answer now, at once

        async with AsyncClient(address) as client:
            held = [client.generate("hold", request_id=f"r{i}") for i in range(3)]
            # No replica serves the stage: the orchestrator says NOT_SERVING (so a
            # Service would drop it: why the chart never scales to zero), and the
            # three requests wait for the stage, and count.
            health = health_pb2_grpc.HealthStub(client.channel)
            check = health_pb2.HealthCheckRequest(service="omni.v1.Orchestrator")
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await eventually(lambda: server.router.in_flight == 3, 10)
            assert await eventually(lambda: metric(scaler, trigger), 10) == 3
            assert server.scaler.demand.of("solo").waiting == 3
            assert (await scaler.IsActive(trigger)).result
            assert (await pushed.read()).result is True

            # A replica comes (and stays until the orchestrator has stopped).
            await later.enter_async_context(replica_on(stage_port, omni_cache_dir))

            # They go to it and are in flight there, still three.
            async def all_at_the_replica() -> bool:
                return server.scaler.demand.of("solo").in_flight == 3

            await eventually(all_at_the_replica, 20, message="never reached the replica")
            assert server.scaler.demand.of("solo").waiting == 0
            assert await metric(scaler, trigger) == 3
            await client.abort("r0")
            assert (await held[0].collect()).done.code_name == "CANCELLED"
            assert await metric(scaler, trigger) == 2
            assert (await scaler.IsActive(trigger)).result
            await client.abort("r1", "r2")
            for stream in held[1:]:
                await stream.collect()
            assert await metric(scaler, trigger) == 0
            assert not (await scaler.IsActive(trigger)).result
            assert (await pushed.read()).result is False  # only changes were pushed

        assert server.scaler.streams == 1
        pushed.cancel()  # KEDA goes: the stream ends on the orchestrator's side too
        await eventually(lambda: server.scaler.streams == 0, 5, message="stream left open")


async def test_a_stream_ends_ok_when_the_orchestrator_stops(stage_port: int) -> None:
    """KEDA's push stream ends at once (OK) when its orchestrator stops, rather than
    at the end of the stop's grace: KEDA dials again and reaches another one."""
    server = OrchestratorServer(pipeline(stage_port))
    port = await server.start("127.0.0.1", 0)
    stopping = None
    try:
        await eventually(lambda: server.monitors["solo"].ready, 30, message="stage not READY")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            scaler = externalscaler_pb2_grpc.ExternalScalerStub(channel)
            pushed = scaler.StreamIsActive(ref(stage="solo"))
            assert (await pushed.read()).result is False
            loop = asyncio.get_running_loop()
            began = loop.time()
            stopping = asyncio.create_task(server.stop(30.0))
            assert await pushed.read() == grpc.aio.EOF
            assert await pushed.code() == grpc.StatusCode.OK
            assert loop.time() - began < 10  # not the 30 s grace
    finally:
        await (stopping if stopping is not None else server.stop(1.0))


@pytest.mark.parametrize(
    ("metadata", "code", "named"),
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "scalerMetadata.stage: missing"),
        ({"stage": "talker"}, grpc.StatusCode.NOT_FOUND, "scalerMetadata.stage"),
        (
            {"stage": "solo", "targetPerReplica": "four"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "scalerMetadata.targetPerReplica",
        ),
        (
            {"stage": "solo", "targetPerReplica": "0"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "scalerMetadata.targetPerReplica",
        ),
    ],
)
async def test_bad_trigger_metadata_is_refused_on_every_call_naming_the_key(
    metadata: dict[str, str], code: grpc.StatusCode, named: str, stage_port: int
) -> None:
    async with scaler_over(stage_port) as (_server, scaler, _address):
        trigger = ref(**metadata)
        calls = [
            scaler.IsActive(trigger),
            scaler.GetMetricSpec(trigger),
            scaler.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=trigger)),
            scaler.StreamIsActive(trigger).read(),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == code
            assert named in (refused.value.details() or "")


async def test_the_target_and_the_metric_name_are_checked_where_they_matter(
    stage_port: int,
) -> None:
    async with scaler_over(stage_port) as (_server, scaler, _address):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await scaler.GetMetricSpec(ref(stage="solo"))  # the HPA needs a target
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "scalerMetadata.targetPerReplica: missing" in (refused.value.details() or "")
        assert not (await scaler.IsActive(ref(stage="solo"))).result  # needs none
        other = pb.GetMetricsRequest(scaledObjectRef=ref(stage="solo"), metricName="queue")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await scaler.GetMetrics(other)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "metricName" in (refused.value.details() or "")


async def test_it_answers_without_a_token_when_clients_need_one(
    tmp_path: Path, stage_port: int
) -> None:
    """KEDA sends no bearer token: the scaler answers it, while the Orchestrator's
    own methods still refuse a caller without one."""
    tokens = tmp_path / "tokens.yaml"
    entries = [{"name": "alice", "token": secrets.token_hex(20)}]
    tokens.write_text(yaml.safe_dump({"tokens": entries}))
    security = SecuritySettings(tokens_file=tokens)
    async with scaler_over(stage_port, security) as (_server, scaler, address):
        assert not (await scaler.IsActive(ref(stage="solo"))).result
        async with AsyncClient(address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.list_stages()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_reflection_lists_it_and_the_documented_grpcurl_calls_answer(
    stage_port: int,
) -> None:
    """docs/api.md's grpcurl lines, as an operator runs them (in a thread: the
    orchestrator answers on this test's event loop)."""
    async with scaler_over(stage_port) as (_server, _scaler, address):
        listed = await asyncio.to_thread(grpcurl, address, "list")
        assert "externalscaler.ExternalScaler" in listed.split()
        body = json.dumps({"scalerMetadata": {"stage": "solo"}})
        method = "externalscaler.ExternalScaler/IsActive"
        assert json.loads(await asyncio.to_thread(grpcurl, address, "-d", body, method)) == {}
        body = json.dumps({"scaledObjectRef": {"scalerMetadata": {"stage": "solo"}}})
        method = "externalscaler.ExternalScaler/GetMetrics"
        reply = json.loads(await asyncio.to_thread(grpcurl, address, "-d", body, method))
        assert reply == {"metricValues": [{"metricName": METRIC}]}  # 0: proto3 omits it
