"""Asking a stage's grpc health whether it serves: the readiness the monitor
trusts once init is over, and how it learns a READY stage went DOWN.

Polling ``Check`` with a timeout, not ``Watch``: a Watch stream on a peer that
vanished without a reset would wait forever, a Check with a timeout does not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STAGE_SERVICE = "omni.v1.Stage"  # readiness is health of the Stage service itself
SERVING = health_pb2.HealthCheckResponse.SERVING
CONFIRM_POLL_S = 0.1  # how often ``not_serving`` asks again while it may wait


@dataclass(frozen=True)
class Down:
    """Why a stage is not serving. ``gone``: nothing answers at its address (the
    connection was refused or reset): its process is not there, so what it held
    is lost; otherwise it is there but says NOT_SERVING (draining, starting) or
    does not answer in time (stopped, overloaded), and may go on."""

    why: str
    gone: bool = False


class HealthProbe:
    """One stage's health, asked on ``channel`` every ``poll_s`` when watching,
    each Check given ``timeout_s`` and ``metadata`` (the mesh token: the stage
    then counts it as the mesh's, not a stranger's, whatever strangers do)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        poll_s: float,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._health = health_pb2_grpc.HealthStub(channel)
        self._poll_s = poll_s
        self._timeout_s = timeout_s
        self._metadata = metadata

    async def not_serving(self, within_s: float = 0.0) -> Down | None:
        """Why the stage is not SERVING (None when it is), asked until ``within_s`` passed."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + within_s
        request = health_pb2.HealthCheckRequest(service=STAGE_SERVICE)
        while True:
            try:
                reply = await self._health.Check(
                    request, timeout=self._timeout_s, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return Down(f"not answering its health check within {self._timeout_s:g}s")
                return Down(f"unreachable ({code.name})", gone=code == grpc.StatusCode.UNAVAILABLE)
            if reply.status == SERVING:
                return None
            if loop.time() >= give_up:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                return Down(f"not serving (health {name})")
            await asyncio.sleep(CONFIRM_POLL_S)

    async def until_down(self, confirm_s: float = 0.0) -> Down:
        """Poll until the stage is not SERVING or unreachable; returns why. An
        unreachable answer is asked again for up to ``confirm_s`` before it counts:
        on a channel over several replicas one Check can go to a replica that just
        died while the others serve on (the channel picks another once it has seen
        the connection go), and the stage is not gone for that."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._poll_s)
            down = await self.not_serving()
            deadline = loop.time() + confirm_s
            while down is not None and down.gone and loop.time() < deadline:
                await asyncio.sleep(CONFIRM_POLL_S)
                down = await self.not_serving()
            if down is not None:
                return down

    async def until_serving_twice(self, starting: Callable[[], bool]) -> None:
        """Return once the stage answers SERVING on two polls in a row, both while
        ``starting()`` (a poll while it is not starts the count again)."""
        seen = 0
        while seen < 2:
            await asyncio.sleep(self._poll_s)
            if not starting():
                seen = 0
                continue
            seen = seen + 1 if await self.not_serving() is None else 0
