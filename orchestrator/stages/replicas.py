"""Every replica of one stage, each with its own channel, health and load.

A ``ReplicaSet`` finds the replicas its stage's address names (``resolver``:
an ``ipv4:`` list, a ``dns:`` name looked up again every ``resolve_s``), asks
each one's grpc health every ``health_poll_s`` on its own channel, and picks the
replica a new request goes to (``pick``): a READY one still named by the
address, the one with the least outstanding work (requests in flight; ties to
the one given fewest), or in turn (``round_robin``, for comparison).

Replica states (``ReplicaState``): STARTING until its health first says SERVING;
READY; DRAINING when it says NOT_SERVING or its name no longer lists it (it
finishes what it holds, gets nothing new); DOWN when nothing answers at its
address (``on_lost``: what it held is failed or moved). A replica no longer
listed leaves once it holds nothing (``on_gone``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from orchestrator.stages.health_probe import Down, HealthProbe
from orchestrator.stages.resolver import Lookup, Target, system_lookup
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.security import PLAINTEXT, Dialing

logger = logging.getLogger(__name__)

STARTING = orchestrator_pb2.REPLICA_STARTING
READY = orchestrator_pb2.REPLICA_READY
DRAINING = orchestrator_pb2.REPLICA_DRAINING
DOWN = orchestrator_pb2.REPLICA_DOWN
Routing = Literal["least_outstanding", "round_robin"]
MAX_AFFINITY_KEYS = 65536  # conversations remembered per stage


@dataclass(frozen=True)
class ReplicaSettings:
    routing: Routing = "least_outstanding"
    affinity: bool = False  # a conversation's requests to the replica that had its last
    resolve_s: float = 5.0  # a dns: name is looked up again this often
    health_poll_s: float = 0.5
    health_timeout_s: float = 1.0
    pick_wait_s: float = 10.0  # a request waits this long for a READY replica


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
        self.listed = True  # still named by the stage's address
        self.in_flight = 0
        self.queued = 0  # in flight, nothing heard from it yet
        self.served = 0
        self.finished_at = 0.0  # when a request last ended there (time.monotonic)

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
        )


class NoReplica(Exception):
    """No replica of the stage takes requests now (the message says what there is)."""


class ReplicaSet:
    def __init__(
        self,
        stage: str,
        address: str,
        dialing: Dialing = PLAINTEXT,
        settings: ReplicaSettings = ReplicaSettings(),
        *,
        lookup: Lookup = system_lookup,
    ) -> None:
        self.stage = stage
        self.target = Target.parse(address)
        self.settings = settings
        self._dialing = _pinned(dialing, self.target.host) if self.target.dns else dialing
        self._lookup = lookup
        self.replicas: dict[str, Replica] = {}
        self._watching: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self._turn = itertools.count()
        self._lost: list[Callable[[Replica, str], None]] = []
        self._gone: list[Callable[[Replica], None]] = []
        self._change: list[Callable[[], None]] = []
        self._lookup_failed = False
        # Conversation -> the address its requests go to, the least recently used first.
        self._affinity: OrderedDict[str, str] = OrderedDict()

    # --- who hears of what ------------------------------------------------------------

    def on_lost(self, callback: Callable[[Replica, str], None]) -> None:
        """``callback(replica, why)`` when a replica stops answering (DOWN)."""
        self._lost.append(callback)

    def on_gone(self, callback: Callable[[Replica], None]) -> None:
        """``callback(replica)`` when a replica no longer listed holds nothing and leaves."""
        self._gone.append(callback)

    def on_change(self, callback: Callable[[], None]) -> None:
        """``callback()`` when a replica comes, goes or changes state."""
        self._change.append(callback)

    def statuses(self) -> list[orchestrator_pb2.ReplicaStatus]:
        return [r.status() for r in self.replicas.values()]

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        await self._resolve()
        if self.target.dns:
            self._tasks.append(asyncio.create_task(self._discover(), name=f"dns-{self.stage}"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._watching.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self.replicas.values()))
        self.replicas.clear()
        self._watching.clear()

    # --- picking ----------------------------------------------------------------------

    async def pick(self, affinity: str = "") -> Replica:
        """The replica a new request goes to (``affinity``: its conversation's key,
        with ``settings.affinity``: the replica its last request went to, while that
        one takes requests); waits (``pick_wait_s``) for a READY one; raises NoReplica."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.settings.pick_wait_s
        key = affinity if self.settings.affinity else ""
        while True:
            kept = self.replicas.get(self._affinity.get(key, "")) if key else None
            if kept is not None and kept.takes_requests:
                self._affinity.move_to_end(key)
                return kept
            replica = self.choose_now()
            if replica is not None:
                if key:
                    self._affinity[key] = replica.address
                    while len(self._affinity) > MAX_AFFINITY_KEYS:
                        self._affinity.popitem(last=False)
                return replica
            left = give_up - loop.time()
            if left <= 0:
                raise NoReplica(self._none_ready())
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    def choose_now(self, exclude: Collection[Replica] = ()) -> Replica | None:
        """The READY replica a request goes to now (``routing``), None if there is none."""
        ready = [r for r in self.replicas.values() if r.takes_requests and r not in exclude]
        return self._choose(ready) if ready else None

    def _choose(self, ready: list[Replica]) -> Replica:
        if self.settings.routing == "round_robin":
            ready.sort(key=lambda r: r.address)
            return ready[next(self._turn) % len(ready)]
        # Ties go to the replica that finished a request last: one held by a long
        # answer has not, and a request sent there would queue behind it.
        return min(ready, key=lambda r: (r.in_flight, -r.finished_at))

    def _none_ready(self) -> str:
        if not self.replicas:
            return f"stage {self.stage}: {self.target.address} names no replica now"
        states = ", ".join(
            f"{r.address} {orchestrator_pb2.ReplicaState.Name(r.status().state)}"
            for r in self.replicas.values()
        )
        return f"stage {self.stage} has no ready replica ({states})"

    def released(self, replica: Replica) -> None:
        """A request on ``replica`` ended: one no longer listed leaves once idle."""
        if not replica.listed and replica.in_flight == 0:
            self._drop(replica)

    # --- discovery --------------------------------------------------------------------

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resolve_s)
            await self._resolve()

    async def _resolve(self) -> None:
        try:
            addresses = await self.target.resolve(self._lookup)
        except OSError as exc:  # keep what we know: a lookup failing is not replicas leaving
            if not self._lookup_failed:
                address = self.target.address
                logger.warning("stage %s: resolving %s failed: %s", self.stage, address, exc)
            self._lookup_failed = True
            return
        self._lookup_failed = False
        for address in addresses:
            replica = self.replicas.get(address)
            if replica is None:
                self._add(address)
            elif not replica.listed:
                replica.listed = True
                self._changed_now()
        for replica in list(self.replicas.values()):
            if replica.address not in addresses and replica.listed:
                logger.info("stage %s: %s is no longer listed", self.stage, replica.name)
                replica.listed = False
                self._changed_now()
                self.released(replica)

    def _add(self, address: str) -> None:
        client = StageClient(address, self._dialing)
        replica = Replica(self.stage, address, client, on_idle=self.released)
        self.replicas[address] = replica
        logger.info("stage %s: found %s", self.stage, replica.name)
        self._watching[address] = asyncio.create_task(
            self._watch(replica), name=f"replica-{self.stage}-{address}"
        )
        self._changed_now()

    def _drop(self, replica: Replica) -> None:
        if self.replicas.get(replica.address) is not replica:
            return
        del self.replicas[replica.address]
        logger.info("stage %s: %s left", self.stage, replica.name)
        for callback in self._gone:
            callback(replica)
        task = self._watching.pop(replica.address)
        task.cancel()
        self._tasks.append(asyncio.create_task(_close(task, replica.client)))
        self._changed_now()

    # --- health -----------------------------------------------------------------------

    async def _watch(self, replica: Replica) -> None:
        probe = HealthProbe(
            replica.client.channel,
            poll_s=self.settings.health_poll_s,
            timeout_s=self.settings.health_timeout_s,
            metadata=replica.client.metadata,
        )
        while True:
            self._observe(replica, await probe.not_serving())
            await asyncio.sleep(self.settings.health_poll_s)

    def _observe(self, replica: Replica, down: Down | None) -> None:
        before = replica.state
        if down is None:
            replica.state, replica.message = READY, ""
        elif down.gone and before in (READY, DRAINING):
            replica.state, replica.message = DOWN, down.why
        elif not down.gone and before == READY:
            replica.state, replica.message = DRAINING, down.why
        elif before == STARTING:
            replica.message = down.why
        if replica.state == before:
            return
        logger.info(
            "stage %s: %s is %s%s",
            self.stage,
            replica.name,
            orchestrator_pb2.ReplicaState.Name(replica.state),
            f" ({replica.message})" if replica.message else "",
        )
        if replica.state == DOWN:
            for callback in self._lost:
                callback(replica, replica.message)
        self._changed_now()

    def _changed_now(self) -> None:
        self._changed.set()
        for callback in self._change:
            callback()


async def _close(watch: asyncio.Task[None], client: StageClient) -> None:
    await asyncio.gather(watch, return_exceptions=True)
    await client.close()


def _pinned(dialing: Dialing, host: str) -> Dialing:
    """Dialing a replica of a ``dns:`` name by its address, TLS still verifies the name."""
    if dialing.credentials is None:
        return dialing
    return _Pinned(dialing.credentials, dialing.token, authority=host)


@dataclass(frozen=True)
class _Pinned(Dialing):
    authority: str = ""

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        pinned = [
            *options,
            ("grpc.ssl_target_name_override", self.authority),
            ("grpc.default_authority", self.authority),
        ]
        return super().channel(address, pinned)
