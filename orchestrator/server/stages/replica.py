"""One replica of a stage: where it is, its channel, its state and its load.

States (``ReplicaState``), from its grpc health (``observe``): STARTING until
its health first says SERVING; READY; DRAINING when it says NOT_SERVING or its
stage's address (or its Pod: not Ready, being deleted) no longer lists it (it
finishes what it holds, gets nothing new); DOWN when nothing answers at its
address (what it held is failed or moved). Its load is this orchestrator's
requests on it: in flight, and of those the ones it has said nothing of yet
(queued); and what it says it holds, every client's (``held``, its Load): those
beyond this orchestrator's are outstanding work there too (``outstanding``). A
request counts as one until it has sent ``LONG_AFTER`` outputs (tokens, audio
windows, steps), then as one more for each ``LONG_AFTER`` beyond: a request that
has run long is likely to run on, and one new request is not worth one that
will hold the replica for hundreds of tokens yet (``beyond``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.server.stages.health_probe import Down
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.rpc.stage_client import StageClient

STARTING = orchestrator_pb2.REPLICA_STARTING
READY = orchestrator_pb2.REPLICA_READY
DRAINING = orchestrator_pb2.REPLICA_DRAINING
DOWN = orchestrator_pb2.REPLICA_DOWN
LONG_AFTER = 16  # outputs after which a request counts as more than one


def beyond(outputs: int) -> int:
    """The outputs of a request that has sent ``outputs`` that count beyond its one."""
    return max(0, outputs - LONG_AFTER)


class Replica:
    """One replica: where it is, its channel, its state, its load (this orchestrator's)."""

    def __init__(
        self,
        stage: str,
        address: str,
        client: StageClient,
        on_idle: Callable[[Replica], None] = lambda _replica: None,
    ) -> None:
        self._on_idle = on_idle
        self.stage = stage
        self.address = address
        self.client = client
        self.state = STARTING
        self.message = "its health has not answered yet"
        self.listed = True  # still named by the stage's address (or a ready Pod)
        self.pod = ""  # where known (Kubernetes)
        self.node = ""
        self.in_flight = 0
        self.queued = 0  # in flight, nothing heard from it yet
        self.served = 0
        self.held = 0  # requests it said it holds, every client's (its last Load)
        self._others = 0  # of those, not this orchestrator's
        self.beyond = 0  # its requests' outputs beyond LONG_AFTER each, summed
        self.finished_at = 0.0  # when a request last ended there (time.monotonic)
        self.picked = 0  # when it was last chosen (its ReplicaChooser's count)

    def took(self) -> None:
        """A request was given to it."""
        self.in_flight += 1
        self.queued += 1
        self.served += 1

    def gave_back(self, heard: bool) -> None:
        """A request given to it ended there (``heard``: it had sent something of it)."""
        self.in_flight -= 1
        self.finished_at = time.monotonic()
        if not heard:
            self.queued -= 1
        if self.in_flight == 0 and not self.listed:
            self._on_idle(self)

    def reported(self, held: int) -> None:
        """It says it holds ``held`` requests, every client's: those beyond this
        orchestrator's in flight now are others' (another orchestrator's), until it
        says again."""
        self.held = held
        self._others = max(0, held - self.in_flight)

    @property
    def outstanding(self) -> float:
        """The work on it now: this orchestrator's requests (long ones more) and
        others' (as it last said)."""
        return self.in_flight + self._others + self.beyond / LONG_AFTER

    def observe(self, down: Down | None) -> bool:
        """Its state after a health answer (``down``: why it does not serve, None
        when it does); True when the state changed."""
        before = self.state
        if down is None:
            self.state, self.message = READY, ""
        elif down.gone and before in (READY, DRAINING):
            self.state, self.message = DOWN, down.why
        elif not down.gone and before == READY:
            self.state, self.message = DRAINING, down.why
        elif before == STARTING:
            self.message = down.why
        return self.state != before

    @property
    def name(self) -> str:
        return f"replica {self.address} of stage {self.stage}"

    @property
    def takes_requests(self) -> bool:
        return self.state == READY and self.listed

    def status(self) -> orchestrator_pb2.ReplicaStatus:
        state = DRAINING if self.state == READY and not self.listed else self.state
        message = "no longer listed by its address" if not self.listed else self.message
        return orchestrator_pb2.ReplicaStatus(
            address=self.address,
            state=state,
            in_flight=self.in_flight,
            queued=self.queued,
            message="" if state == READY else message,
            served=self.served,
            pod=self.pod,
            node=self.node,
            held=self.held,
        )
