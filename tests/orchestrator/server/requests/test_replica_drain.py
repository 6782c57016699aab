"""A replica told to stop (SIGTERM) drains: it refuses new requests at once, as not
serving, while the orchestrator learns it from its health only at the next poll.
A request it refused in that window moves to another replica, and the replica
gets no new one from then on. The replicas are stage processes (the scripted
engine); the orchestrator's health poll is made long so that the window is."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.server import OrchestratorServer
from orchestrator.server.stages.replica import DRAINING
from services.mesh.rpc.stage_client import StageClient
from tests.helpers.polling import eventually
from tests.orchestrator.server.requests.test_replicas import all_ready, replica_view, scripted, solo


async def not_serving(address: str) -> bool:
    async with StageClient(address) as stage:
        request = health_pb2.HealthCheckRequest(service="omni.v1.Stage")
        reply = await health_pb2_grpc.HealthStub(stage.channel).Check(request)
    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_request_a_draining_replica_refused_moves_to_another(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    config = tmp_path / "solo.yaml"
    config.write_text(yaml.safe_dump(scripted(omni_cache_dir)))
    processes = [StageProcess(config, host=f"127.0.0.{host}") for host in (1, 2)]
    try:
        a, b = [await process.start() for process in processes]
        for address in (a, b):
            async with StageClient(address) as stage:
                await stage.wait_ready(timeout_s=60)
        server = OrchestratorServer(solo(f"ipv4:{a},{b}", "round_robin"))
        found = server.replicas["solo"]
        found.settings = dataclasses.replace(found.settings, health_poll_s=60.0)
        port = await server.start("127.0.0.1", 0)
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                await client.wait_ready(timeout_s=60)
                await all_ready(client, 2)
                # In turn: one long request on a, one on b, which then holds it as it drains.
                held = [client.generate("hold", request_id=f"hold-{i}") for i in range(2)]
                await eventually(lambda: server.router.in_flight == 2, 10)
                stopping = asyncio.create_task(processes[1].stop(30.0))
                await eventually(lambda: not_serving(b), 10, message="b never drained")
                assert (await replica_view(client))[b].state != DRAINING  # not polled yet

                # In turn again: a, then b, which refuses it; it moves to a.
                results = [await client.generate("Hi").collect() for _ in range(2)]
                assert all(r.ok for r in results), [r.done for r in results]
                view = await replica_view(client)
                assert view[b].state == DRAINING and "refused a request" in view[b].message
                assert (view[a].served, view[b].served) == (3, 2)  # each was given it
                assert (view[a].in_flight, view[b].in_flight) == (1, 1)
                # b gets nothing more; its long request is stopped and it exits drained.
                again = await client.generate("Hi").collect()
                assert again.ok and (await replica_view(client))[a].served == 4
                await client.abort("hold-0", "hold-1")
                for stream in held:
                    assert (await stream.collect()).done.code_name == "CANCELLED"
                assert await stopping == 0
        finally:
            await server.stop(1.0)
    finally:
        await asyncio.gather(*(process.stop(1.0) for process in processes))
