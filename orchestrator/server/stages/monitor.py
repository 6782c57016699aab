"""StageMonitor: drives one stage's Watchdog from the live stage, and watches it after.

One task follows the stage (InitStatus, then grpc health); a second one wakes when
the watchdog could next fail and publishes the countdown. States (StageState):

- STARTING: init under the watchdog. Not reachable yet, or InitStatus broken: the
  watchdog falls back to the plain deadline and the connection is retried with
  backoff; grpc health SERVING also counts as ready.
- READY: health is polled every ``health_poll_s``.
- FAILED: the watchdog timed out or the stage reported FAILED (the monitor kills
  nothing). The verdict stands until a new stage process appears.
- DOWN: was READY, now NOT_SERVING, not answering or unreachable; reconnects with
  backoff. The same process answering SERVING again is READY again (a network blip);
  a new process (a STARTING with a new wall time) starts a fresh watchdog attempt:
  STARTING → READY. Its launcher seeing the process exit (``process_exited``) makes
  it DOWN at once, whatever health would say at its next poll; ``lost`` says the
  process is gone (exited, or its address refuses), not merely slow or draining.

A READY stage the pipeline cannot use as it is (an edge's transform it does not
offer: ``refuse``) shows FAILED with the reason until a new process appears.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from orchestrator.server.stages.health_probe import Down, HealthProbe
from orchestrator.server.stages.phase_metrics import PhaseDurations
from orchestrator.server.stages.status_feed import StatusFeed
from orchestrator.server.stages.watchdog import Watchdog, WatchdogSettings
from services.mesh.errors import DeadlineExceeded, InitFailed, OmniError, Unavailable
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.security import PLAINTEXT, Dialing

logger = logging.getLogger(__name__)

STARTING = orchestrator_pb2.STAGE_STARTING
READY = orchestrator_pb2.STAGE_READY
FAILED = orchestrator_pb2.STAGE_FAILED
DOWN = orchestrator_pb2.STAGE_DOWN
COUNTDOWN_S = 1.0  # changes() publishes at least this often while STARTING
# A stage publishes READY a moment before it flips its health to SERVING.
CONFIRM_S = 2.0
# A READY stage's health channel found nothing at its address is asked again for
# up to this long before the stage counts as gone and every request it holds
# fails: over several replicas that Check may have gone to the one replica that
# just died (the requests it held fail by their own streams, naming it).
GONE_CONFIRM_S = 1.0
StateName = orchestrator_pb2.StageState.Name


@dataclass(frozen=True)
class StageTarget:
    name: str
    address: str
    settings: WatchdogSettings


class StageMonitor:
    def __init__(
        self,
        target: StageTarget,
        *,
        clock: Callable[[], float] = time.monotonic,
        reconnect_initial_s: float = 0.2,
        reconnect_max_s: float = 5.0,
        health_poll_s: float = 0.5,
        health_timeout_s: float = 1.0,
        dialing: Dialing = PLAINTEXT,
    ) -> None:
        self._dialing = dialing
        self.target = target
        self._clock = clock
        self._reconnect = (reconnect_initial_s, reconnect_max_s)
        self._health_poll_s = health_poll_s
        self._health_timeout_s = health_timeout_s
        self._watchdog = Watchdog(target.name, target.settings, clock)
        self._down: str | None = None  # why a READY stage is DOWN now
        self.lost = False  # DOWN because its process is gone (exited, refused)
        self._refused: str | None = None  # why the pipeline cannot use this process
        self._client: StageClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._feed = StatusFeed(target.name)
        self._changed = asyncio.Event()  # wakes the ticker when the watchdog changed
        self._last_state = STARTING
        self._last_published = 0.0
        self._unreachable_logged = False
        self._phases = PhaseDurations(target.name)  # init phase durations as metrics
        # Every replica's status, shown in the stage's (``replicas.ReplicaSet``).
        self.replicas: Callable[[], list[orchestrator_pb2.ReplicaStatus]] = list

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            raise RuntimeError(f"monitor of stage {self.target.name} already started")
        self._watchdog = Watchdog(self.target.name, self.target.settings, self._clock)
        logger.info("stage %s: watching %s", self.target.name, self.target.address)
        name = self.target.name
        self._tasks = [
            asyncio.create_task(self._follow(), name=f"monitor-{name}"),
            asyncio.create_task(self._tick(), name=f"monitor-{name}-ticker"),
        ]
        self._publish()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._feed.close()

    # --- outputs --------------------------------------------------------------------

    @property
    def status(self) -> orchestrator_pb2.StageStatus:
        status = self._watchdog.status(self.target.address)
        if self._refused is not None and status.state == READY:
            status.state, status.message = FAILED, self._refused
        elif self._down is not None and status.state == READY:
            status.state, status.message = DOWN, self._down
        status.replicas.extend(self.replicas())
        return status

    def replicas_changed(self) -> None:
        """A replica came, went or changed state: watchers hear the stage again."""
        if self._tasks:
            self._publish()

    def refuse(self, reason: str) -> None:
        """FAILED with ``reason`` (the pipeline's, not the stage's fault) until a new
        process of the stage appears."""
        self._refused = reason
        self._publish()

    def process_exited(self, code: int | None) -> None:
        """Its launcher saw the stage's process exit: DOWN now (the process that
        comes next at the address starts a new attempt)."""
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"code {code}"
        self._go_down(Down(f"its process exited ({how})", gone=True))

    @property
    def ready(self) -> bool:
        return self.status.state == READY

    def on_change(self, callback: Callable[[orchestrator_pb2.StageStatus], None]) -> None:
        """Call ``callback`` on the event loop with every published status."""
        self._feed.on_change(callback)

    async def changes(self) -> AsyncIterator[orchestrator_pb2.StageStatus]:
        """The current status, then every change (a slow reader gets the latest ones)."""
        async for status in self._feed.follow(self.status):
            yield status

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Return once READY; raise the watchdog's error if init FAILED."""

        async def until_ready() -> None:
            async for status in self.changes():
                if status.state == READY:
                    return
                if status.state == FAILED:
                    raise self._watchdog.error or InitFailed(status.message)
            raise Unavailable(f"monitor of stage {self.target.name} stopped")

        try:
            await asyncio.wait_for(until_ready(), timeout_s)
        except TimeoutError:
            status = self.status
            raise DeadlineExceeded(
                f"stage {self.target.name} at {self.target.address} not ready within "
                f"{timeout_s:.1f}s ({StateName(status.state)}: {status.message})"
            ) from None

    def _publish(self) -> None:
        status = self.status
        if status.state != self._last_state:
            logger.info(
                "stage %s: %s -> %s: %s",
                self.target.name,
                StateName(self._last_state),
                StateName(status.state),
                status.message,
            )
            self._last_state = status.state
        self._last_published = asyncio.get_running_loop().time()
        self._changed.set()
        self._feed.publish(status)

    # --- the ticker: deadlines and countdown ----------------------------------------

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            delay = self._watchdog.next_check_in()
            if self._watchdog.state == STARTING:
                to_countdown = self._last_published + COUNTDOWN_S - loop.time()
                delay = to_countdown if delay is None else min(delay, to_countdown)
            if delay is None or delay > 0:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                # cancel that lands as the event is set, and stop() then waits on
                # this loop forever.
                try:
                    async with asyncio.timeout(delay):
                        await self._changed.wait()
                    continue  # something changed: recompute
                except TimeoutError:
                    pass
            try:
                self._watchdog.check()
            except OmniError:
                pass  # the state is FAILED now; published below
            if self._watchdog.state != STARTING and self._last_state != STARTING:
                continue  # nothing counts down, and nothing changed
            self._publish()

    # --- the follower: InitStatus, then health --------------------------------------

    async def _follow(self) -> None:
        initial, most = self._reconnect
        delay = initial
        while True:
            try:
                if await self._session():
                    delay = initial
            except Exception:  # a bug here must not end the watching of a live stage
                logger.exception("stage %s: monitor session failed", self.target.name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, most)

    async def _session(self) -> bool:
        """One connection: follow init, then health. True if the stage was READY."""
        if self._client is not None:
            await self._client.close()
        # A fresh channel per attempt: our backoff, not the channel's own (up to 2
        # minutes), decides when a stage that was down is tried again.
        self._client = client = StageClient(
            self.target.address, self._dialing, route_by_health=True
        )
        # Health asked on the channel that routes by health: SERVING while any
        # replica of the stage serves, so one replica starting or draining beside
        # serving ones neither holds the stage STARTING nor turns it DOWN.
        health = HealthProbe(
            client.serving_channel,
            poll_s=self._health_poll_s,
            timeout_s=self._health_timeout_s,
            metadata=client.metadata,
        )
        try:
            await self._follow_init_or_a_serving_replica(client, health)
        except grpc.aio.AioRpcError as exc:
            self._lost(exc)
        if self._watchdog.state == STARTING and await health.not_serving() is None:
            self._watchdog.mark_ready("ready per grpc health (InitStatus unavailable)")
            self._publish()
        if self._watchdog.state != READY:
            return False
        if down := await health.not_serving(CONFIRM_S):
            if self._down is None:
                self._go_down(down)
            return False
        self._unreachable_logged = False
        if self._down is not None:
            self._down, self.lost = None, False
            self._publish()
        self._go_down(await health.until_down(GONE_CONFIRM_S))
        return True

    async def _follow_init_or_a_serving_replica(
        self, client: StageClient, health: HealthProbe
    ) -> None:
        """Follow InitStatus, which reaches one replica. With several, another may be
        serving while that one waits (for its device, say): a replica seen SERVING on
        two polls in a row while the stage is still STARTING makes it READY. A single
        replica's own READY event comes first (it is sent before health turns)."""
        follow = asyncio.create_task(self._follow_init(client))
        serving = asyncio.create_task(health.until_serving_twice(self._starting))
        try:
            await asyncio.wait((follow, serving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (follow, serving):
                task.cancel()
            await asyncio.gather(follow, serving, return_exceptions=True)
        if follow.done() and not follow.cancelled():
            follow.result()  # its AioRpcError is the session's to handle
        elif self._watchdog.state == STARTING:
            self._watchdog.mark_ready("a replica serves (grpc health); another is starting")
            self._publish()

    def _starting(self) -> bool:
        return self._watchdog.state == STARTING

    async def _follow_init(self, client: StageClient) -> None:
        async for event in client.init_events():
            self._unreachable_logged = False
            if self._watchdog.is_new_process(event):
                logger.info(
                    "stage %s: a new process answers at %s; new init attempt",
                    self.target.name,
                    self.target.address,
                )
                self._down = self._refused = None
                self.lost = False
                self._watchdog.restart()
                self._phases.new_process()
            self._phases.record(event)
            before = self._key()
            self._watchdog.observe(event)
            if self._key() != before:  # replays change nothing and publish nothing
                self._publish()
        if self._watchdog.state == STARTING:  # the stream ended before READY or FAILED
            self._watchdog.stream_lost("InitStatus ended early: plain deadline")
            self._publish()

    def _key(self) -> tuple[object, ...]:
        w = self._watchdog
        return (w.attempt, w.state, w.phase, w.paused, w.bytes_done, w.bytes_total, w.message)

    def _go_down(self, down: Down) -> None:
        if self._down is not None and self.lost:
            return  # its process is gone: the first word on it says the most
        self._down = f"stage {self.target.name} at {self.target.address} is down: {down.why}"
        self.lost = down.gone
        self._publish()

    def _lost(self, exc: grpc.aio.AioRpcError) -> None:
        if not self._unreachable_logged:
            logger.info(
                "stage %s: InitStatus from %s failed (%s); retrying with backoff",
                self.target.name,
                self.target.address,
                exc.code().name,
            )
            self._unreachable_logged = True
        if self._watchdog.state == STARTING:
            self._watchdog.stream_lost(f"InitStatus unavailable ({exc.code().name})")
            self._publish()
