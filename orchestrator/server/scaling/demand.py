"""What each stage is asked for now: the requests waiting for it plus those in
flight at its replicas, as this orchestrator carries them.

Waiting: held in the gate while the stage cannot take a request (not READY, or
its Describe pending: ``requests.gate``), or in its ReplicaSet's ``pick`` for a
READY replica. In flight: given to one of its replicas and not ended, queued
there or generating (``Replica.in_flight``). A request counts at a stage only
once it needs that stage now: one whose thinker still runs is not yet the
talker's. Another orchestrator's requests are not counted here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from orchestrator.server.stages.replicas import ReplicaSet


@dataclass(frozen=True)
class Demand:
    waiting: int  # for the stage (no replica takes them yet)
    in_flight: int  # at its replicas

    @property
    def requests(self) -> int:
        return self.waiting + self.in_flight


class Holding(Protocol):
    """Where requests wait for a stage before they are routed (``StageGate``)."""

    def waiting(self, stage: str) -> int: ...


class StageDemand:
    """Every stage's demand, read from the gate and the stages' ReplicaSets."""

    def __init__(self, gate: Holding, replicas: Mapping[str, ReplicaSet]) -> None:
        self._gate = gate
        self._replicas = replicas

    @property
    def stages(self) -> Collection[str]:
        return self._replicas.keys()

    def of(self, stage: str) -> Demand:
        replica_set = self._replicas[stage]
        in_flight = sum(r.in_flight for r in replica_set.replicas.values())
        return Demand(self._gate.waiting(stage) + replica_set.waiting, in_flight)
