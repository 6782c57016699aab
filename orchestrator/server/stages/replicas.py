"""Every replica of one stage: found, watched, and the one a new request goes to.

A ``ReplicaSet`` finds the replicas its stage's address names (``resolver``:
an ``ipv4:`` list, a ``dns:`` name looked up again every ``resolve_s``) or, for a
stage that names its Pods, the ready ones the Kubernetes API shows (``kube_source``;
DNS again where the API cannot be asked, said once), gives
each (``replica``) its own channel, asks each one's grpc health every
``health_poll_s`` on it (and a READY one's Load: what it holds, every client's),
and picks the replica a new request goes to (``pick``,
by ``routing``), waiting a while for one that takes requests.

Who hears of what: ``on_lost`` when a replica goes DOWN (what it held is failed
or moved), ``on_gone`` when a replica no longer listed leaves (once it holds
nothing), ``on_change`` when any replica comes, goes or changes state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc

from orchestrator.server.stages.health_probe import Down, HealthProbe
from orchestrator.server.stages.kube_source import KubeSettings, PodReplica, PodWatch
from orchestrator.server.stages.replica import DOWN, READY, Replica
from orchestrator.server.stages.resolver import Lookup, Target, pinned_dialing, system_lookup
from orchestrator.server.stages.routing import ReplicaChooser, Routing
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.security import PLAINTEXT, Dialing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSettings:
    routing: Routing = "least_outstanding"
    affinity: bool = False  # a conversation's requests to the replica that had its last
    # a dns: name is looked up again this often: a headless Service lists a Pod once it
    # is Ready, so this bounds how long a new replica waits for its first request
    resolve_s: float = 1.0
    health_poll_s: float = 0.5
    health_timeout_s: float = 1.0
    pick_wait_s: float = 10.0  # a request waits this long for a READY replica
    kube: KubeSettings = field(default_factory=KubeSettings)  # watching its Pods (``pods``)


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
        pods: str = "",
        lookup: Lookup = system_lookup,
    ) -> None:
        """``pods``: a label selector of the stage's Pods, watched through the
        Kubernetes API; the address's port is theirs, its name the fallback."""
        self.stage = stage
        self.pods = pods
        self.target = Target.parse(address)
        self.settings = settings
        self._dialing = pinned_dialing(dialing, self.target.host) if self.target.dns else dialing
        self._lookup = lookup
        self.replicas: dict[str, Replica] = {}
        self._watching: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self._chooser = ReplicaChooser(settings.routing, settings.affinity)
        self._lost: list[Callable[[Replica, str], None]] = []
        self._gone: list[Callable[[Replica], None]] = []
        self._change: list[Callable[[], None]] = []
        self._lookup_failed = False
        self.waiting = 0  # requests in ``pick`` now, waiting for a READY replica
        self._pod_watch: PodWatch | None = None
        self._first_pods: asyncio.Future[bool] | None = None  # True: pods, False: DNS
        self._stopped = False

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
        if self.pods:
            port = self.target.port or int(self.target.address.rpartition(":")[2])
            self._first_pods = asyncio.get_running_loop().create_future()
            self._pod_watch = PodWatch(
                self.stage, self.pods, port, self._pods_now, self._fall_back, self.settings.kube
            )
            self._pod_watch.start()
            try:  # the replicas known at start, as with DNS; else found as they come
                wait = self.settings.pick_wait_s
                by_pods = await asyncio.wait_for(asyncio.shield(self._first_pods), wait)
            except TimeoutError:
                logger.warning("stage %s: its pods are not listed yet", self.stage)
                by_pods = True
            self._first_pods = None
            if by_pods:
                return
        await self._find_by_address()

    async def _find_by_address(self) -> None:
        await self._resolve()
        if self.target.dns:
            self._tasks.append(asyncio.create_task(self._discover(), name=f"dns-{self.stage}"))

    async def stop(self) -> None:
        self._stopped = True
        if self._pod_watch is not None:
            await self._pod_watch.stop()
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
        replica = self._chooser.pick_now(self.replicas, affinity)
        if replica is not None:
            return replica
        self.waiting += 1
        try:
            return await self._wait_pick(affinity)
        finally:
            self.waiting -= 1

    async def _wait_pick(self, affinity: str) -> Replica:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.settings.pick_wait_s
        while True:
            replica = self._chooser.pick_now(self.replicas, affinity)
            if replica is not None:
                return replica
            left = give_up - loop.time()
            if left <= 0:
                raise NoReplica(self._none_ready())
            self._changed.clear()
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def choose_now(self, exclude: Collection[Replica] = ()) -> Replica | None:
        """The READY replica a request goes to now (``routing``), None if there is none."""
        return self._chooser.choose(self.replicas.values(), exclude)

    def _none_ready(self) -> str:
        if not self.replicas:
            return f"stage {self.stage}: {self.target.address} names no replica now"
        states = ", ".join(
            f"{r.address} {orchestrator_pb2.ReplicaState.Name(r.status().state)}"
            for r in self.replicas.values()
        )
        return f"stage {self.stage} has no ready replica ({states})"

    def refused(self, replica: Replica, why: str) -> None:
        """``replica`` refused a request as not serving (draining, say): it is taken
        at its word before its health says so, until its health says it serves."""
        if replica.observe(Down(f"it refused a request: {why}")):
            self._state_changed(replica)

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
        self._listed(addresses)

    def _pods_now(self, pods: dict[str, PodReplica]) -> None:
        """The ready Pods now (from the watch's thread, on the loop)."""
        if self._stopped:
            return
        if self._first_pods is not None and not self._first_pods.done():
            self._first_pods.set_result(True)
        self._listed(list(pods))
        for address, pod in pods.items():
            replica = self.replicas[address]
            if (replica.pod, replica.node) != (pod.pod, pod.node):  # found, or an IP reused
                replica.pod, replica.node = pod.pod, pod.node
                self._changed_now()

    def _fall_back(self, why: str) -> None:
        """The Kubernetes API is not to be used: by DNS from now on, said once."""
        if self._stopped:
            return
        self._pod_watch = None
        logger.warning(
            "stage %s: %s: finding its replicas by DNS (%s) instead",
            self.stage,
            why,
            self.target.address,
        )
        if self._first_pods is not None and not self._first_pods.done():
            self._first_pods.set_result(False)  # start() goes on by DNS
        else:
            self._tasks.append(
                asyncio.create_task(self._find_by_address(), name=f"dns-{self.stage}-fallback")
            )

    def _listed(self, addresses: list[str]) -> None:
        """``addresses`` are the replicas now: new ones are added, missing ones drain."""
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
        asks_load = True  # until it says it has no Load (a stage from before it)
        while True:
            if replica.observe(await probe.not_serving()):
                self._state_changed(replica)
            if replica.state == READY and asks_load:
                asks_load = await self._ask_load(replica)
            await asyncio.sleep(self.settings.health_poll_s)

    async def _ask_load(self, replica: Replica) -> bool:
        """What ``replica`` holds now, every client's; False when it has no Load."""
        try:
            load = await replica.client.load(self.settings.health_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                logger.info("stage %s: %s does not say its load", self.stage, replica.name)
                return False
            return True  # its health says what is wrong; its last word stands meanwhile
        replica.reported(load.held)
        return True

    def _state_changed(self, replica: Replica) -> None:
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
