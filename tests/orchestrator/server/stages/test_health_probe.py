"""HealthProbe against a real grpc health server: one unreachable answer on a
channel over several replicas is asked again before the stage counts as gone,
and a stage that stays unreachable is still found gone."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.server.stages.health_probe import STAGE_SERVICE, HealthProbe


class Flaky(health_pb2_grpc.HealthServicer):
    """SERVING, except that the Checks numbered in ``unavailable`` fail UNAVAILABLE
    (as a Check that went to a replica dying under it does)."""

    def __init__(self, unavailable: set[int]) -> None:
        self.unavailable = unavailable
        self.calls = 0

    async def Check(self, request, context):
        self.calls += 1
        assert request.service == STAGE_SERVICE
        if self.calls in self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def serve(servicer: Flaky) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_one_unreachable_check_is_asked_again_before_the_stage_counts_as_gone() -> None:
    servicer = Flaky(unavailable={3})
    server, address = await serve(servicer)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            probe = HealthProbe(channel, poll_s=0.05, timeout_s=1.0)
            watching = asyncio.create_task(probe.until_down(confirm_s=1.0))
            await asyncio.sleep(0.6)  # ~10 polls, the third one UNAVAILABLE
            assert servicer.calls >= 5, servicer.calls
            assert not watching.done(), watching.result()
            # A stage that stays unreachable is gone once the confirmation ran out.
            await server.stop(0)
            down = await asyncio.wait_for(watching, 5)
            assert down.gone and "unreachable" in down.why, down
    finally:
        await server.stop(0)


async def test_without_confirmation_one_unreachable_check_is_the_stage_gone() -> None:
    """The same one answer, not asked again: what the confirmation is there for."""
    servicer = Flaky(unavailable={3})
    server, address = await serve(servicer)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            probe = HealthProbe(channel, poll_s=0.05, timeout_s=1.0)
            down = await asyncio.wait_for(probe.until_down(), 5)
            assert down.gone and "UNAVAILABLE" in down.why, down
            assert servicer.calls == 3
    finally:
        await server.stop(0)
