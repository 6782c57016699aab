"""A stage's demand (orchestrator/server/scaling/demand.py) from the real gate and a real
ReplicaSet: a request waiting in the ReplicaSet's pick for a READY replica counts
as waiting, and leaves the count when it gives up; one given to a replica counts
in flight there until it ends there."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.server.requests.gate import StageGate
from orchestrator.server.scaling.demand import Demand, StageDemand
from orchestrator.server.stages.replicas import NoReplica, ReplicaSet, ReplicaSettings
from services.mesh.pb.omni.v1 import orchestrator_pb2
from tests.helpers.ports import free_port


class Ready:
    status = orchestrator_pb2.StageStatus(state=orchestrator_pb2.STAGE_READY)


async def test_a_pick_waiting_for_a_replica_counts_and_one_given_counts_in_flight() -> None:
    # Nothing serves at the address: the replica never turns READY.
    settings = ReplicaSettings(pick_wait_s=0.3, health_poll_s=0.05, health_timeout_s=0.1)
    replicas = ReplicaSet("solo", f"127.0.0.1:{free_port()}", settings=settings)
    await replicas.start()
    try:
        demand = StageDemand(StageGate({"solo": Ready()}, {"solo"}, 30), {"solo": replicas})
        assert demand.of("solo") == Demand(waiting=0, in_flight=0)
        picks = [asyncio.create_task(replicas.pick()) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert demand.of("solo") == Demand(waiting=2, in_flight=0)
        for pick in picks:
            with pytest.raises(NoReplica):
                await pick
        assert demand.of("solo").requests == 0
        (replica,) = replicas.replicas.values()
        replica.took()  # as a request routed there would be (stage_mux)
        assert demand.of("solo") == Demand(waiting=0, in_flight=1)
        replica.gave_back(heard=True)
        assert demand.of("solo").requests == 0
    finally:
        await replicas.stop()
