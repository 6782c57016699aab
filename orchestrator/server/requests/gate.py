"""The gate a request passes before it is routed: every stage it needs READY and
described, by the monitors' word (the one truth about a stage, which the router,
ListStages and WatchStages all read).

A stage that is only briefly unable (DOWN: its process died or stopped answering;
STARTING: ``omni up`` restarted it) is waited for, up to ``wait_s`` and never past
the request's own deadline, so a client's request sent while a stage restarts is
served once it is back instead of failing. One that is FAILED is refused at once
(a verdict that stands until a new process appears). A request that gives up is
refused UNAVAILABLE naming the stage and its state; it is never routed to an
address whose process is gone. ``waiting(stage)`` counts the requests held for a
stage now (what a stage's autoscaler reads: orchestrator/server/scaling).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Protocol

from orchestrator.server.requests.errors import NotStarted
from services.mesh.errors import Unavailable
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2

StateName = orchestrator_pb2.StageState.Name
READY = orchestrator_pb2.STAGE_READY
FAILED = orchestrator_pb2.STAGE_FAILED


class Watched(Protocol):
    """What the gate reads of a stage: its monitor's status now."""

    @property
    def status(self) -> orchestrator_pb2.StageStatus: ...


class StageGate:
    """``stages``: each stage's monitor (``stages.monitor``); ``described``: the
    stages whose Describe has come (the orchestrator routes only those)."""

    def __init__(
        self,
        stages: Mapping[str, Watched],
        described: Container[str],
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stages = stages
        self._described = described
        self.wait_s = wait_s
        self._clock = clock
        self._changed = asyncio.Event()
        self._waiting: Counter[tuple[str, ...]] = Counter()  # the stages each waiter needs

    def reason(self, stage: str) -> str | None:
        """Why ``stage`` cannot take a request now (its state and message); None
        when it can."""
        status = self._stages[stage].status
        if status.state == READY:
            return None if stage in self._described else "READY, its Describe is pending"
        detail = status.message or stage_pb2.InitPhase.Name(status.phase)
        return f"{StateName(status.state)} ({detail})"

    def waiting(self, stage: str) -> int:
        """Requests held here now that need ``stage``, while it cannot take them."""
        if self.reason(stage) is None:
            return 0
        return sum(n for stages, n in self._waiting.items() if stage in stages)

    def changed(self) -> None:
        """A stage's status (or description) changed: waiting requests look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until_ready(self, stages: Sequence[str], deadline: float | None) -> None:
        """Return once every one of ``stages`` can take a request; raise NotStarted
        (UNAVAILABLE) naming the first that cannot when one is FAILED, when ``wait_s``
        has passed, or at ``deadline`` (the request's, ``time.monotonic()``)."""
        key = tuple(stages)
        self._waiting[key] += 1
        try:
            await self._until_ready(stages, deadline)
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]

    async def _until_ready(self, stages: Sequence[str], deadline: float | None) -> None:
        began = self._clock()
        give_up = began + self.wait_s
        if deadline is not None:
            give_up = min(give_up, began + deadline - time.monotonic())
        while True:
            blocked = next(((s, r) for s in stages if (r := self.reason(s)) is not None), None)
            if blocked is None:
                return
            stage, why = blocked
            left = give_up - self._clock()
            if self._stages[stage].status.state == FAILED or left <= 0:
                waited = self._clock() - began
                after = f" after waiting {waited:.1f}s" if waited >= 0.05 else ""
                raise NotStarted(stage, Unavailable(f"stage {stage} is not ready{after}: {why}"))
            changed = self._changed
            try:
                async with asyncio.timeout(left):
                    await changed.wait()
            except TimeoutError:
                continue
