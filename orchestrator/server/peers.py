"""The other orchestrators over the same stages, so a call behaves the same
whichever one it lands on (docs/api.md, "More than one orchestrator").

A request lives in the orchestrator that took it. An ``Abort`` for ids not held
here is passed on to every peer; ``PauseGeneration`` and ``ResumeGeneration`` are
applied here and passed on to every peer. A passed-on call carries
``omni-forwarded-by: <this orchestrator's instance id>``: its receiver acts on
it alone and never passes it on again (no loops), and one that finds its own
id in it (itself listed among its peers, as a headless Service lists every Pod)
does nothing at all. The caller's own bearer token goes with the call, so the
peer decides what the caller may do exactly as this one did; TLS is the mesh's
(a ``dns:`` name's addresses are dialled with TLS still verifying the name).

Peers are a gRPC target (``ipv4:a:p,b:p``, ``dns:name:port``, ``host:port``),
looked up again at every call passed on (calls passed on are rare: aborts and
pauses). A peer that does not answer (UNAVAILABLE, or no answer in
``timeout_s``) is taken to hold nothing: an orchestrator that is gone has failed
the requests it carried. Any other refusal by a peer is logged and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

import grpc

from orchestrator.server.stages.resolver import Lookup, Target, pinned_dialing, system_lookup
from services.mesh.pb.externalscaler import externalscaler_pb2, externalscaler_pb2_grpc
from services.mesh.pb.omni.v1 import orchestrator_pb2, orchestrator_pb2_grpc, stage_pb2
from services.mesh.rpc.stage_client import CHANNEL_OPTIONS
from services.mesh.security import Dialing

logger = logging.getLogger(__name__)

FORWARDED_BY = "omni-forwarded-by"
_UNREACHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
Metadata = Sequence[tuple[str, str]]
T = TypeVar("T")


def forwarded_by(metadata: Collection[tuple[str, Any]] | None) -> str | None:
    """The instance id of the orchestrator that passed this call on; None: a client's call."""
    for key, value in metadata or ():
        if key == FORWARDED_BY and isinstance(value, str):
            return value
    return None


def passed_on(metadata: Collection[tuple[str, Any]] | None) -> tuple[tuple[str, str], ...]:
    """What of a client's call goes on to a peer: its bearer token, nothing else."""
    return tuple((k, v) for k, v in metadata or () if k == "authorization" and isinstance(v, str))


class Peers:
    """``target``: the peers' gRPC target ("" none: this orchestrator is alone).
    ``dialing``: the mesh's TLS (its token is not sent: the caller's is)."""

    def __init__(
        self,
        target: str = "",
        dialing: Dialing | None = None,
        *,
        lookup: Lookup = system_lookup,
        timeout_s: float = 5.0,
    ) -> None:
        self.instance = secrets.token_hex(8)  # this process's, for the calls it passes on
        self.target = Target.parse(target) if target else None
        credentials = None if dialing is None else dialing.credentials
        self._dialing = Dialing(credentials)
        if self.target is not None and self.target.dns:
            self._dialing = pinned_dialing(self._dialing, self.target.host)
        self._lookup = lookup
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()  # channels of peers gone

    def __bool__(self) -> bool:
        return self.target is not None

    @property
    def dialled(self) -> list[str]:
        """The peers' addresses with a channel open now."""
        return list(self._channels)

    def is_self(self, metadata: Collection[tuple[str, Any]] | None) -> bool:
        return forwarded_by(metadata) == self.instance

    async def abort(self, request_ids: list[str], metadata: Metadata) -> list[str]:
        """Abort ``request_ids`` on every peer; the ids some peer aborted."""
        if not self or not request_ids:
            return []
        request = stage_pb2.AbortRequest(request_ids=request_ids)
        replies = await self._each(
            lambda channel, md: _orchestrator(channel).Abort(request, metadata=md), metadata
        )
        aborted = {rid for reply in replies for rid in reply.aborted}
        return [rid for rid in request_ids if rid in aborted]

    async def pause(self, metadata: Metadata) -> int:
        """Pause every peer; how many did."""
        request = orchestrator_pb2.PauseGenerationRequest()
        calls = await self._each(
            lambda channel, md: _orchestrator(channel).PauseGeneration(request, metadata=md),
            metadata,
        )
        return len(calls)

    async def resume(self, metadata: Metadata) -> int:
        """Resume every peer; how many did."""
        request = orchestrator_pb2.ResumeGenerationRequest()
        calls = await self._each(
            lambda channel, md: _orchestrator(channel).ResumeGeneration(request, metadata=md),
            metadata,
        )
        return len(calls)

    async def demand(self, request: externalscaler_pb2.GetMetricsRequest) -> float:
        """The metric ``request`` asks for, summed over every peer: each counts only
        the requests it carries, so a stage's demand is the sum (KEDA asks one
        orchestrator, whichever the Service picks)."""
        replies = await self._each(
            lambda channel, md: externalscaler_pb2_grpc.ExternalScalerStub(channel).GetMetrics(
                request, metadata=md
            ),
            (),
        )
        return sum(v.metricValueFloat for reply in replies for v in reply.metricValues)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), *self._closing)

    async def _each(
        self,
        call: Callable[[grpc.aio.Channel, Metadata], Awaitable[T]],
        metadata: Metadata,
    ) -> list[T]:
        """``call`` on every peer at once; the replies of those that answered."""
        if self.target is None:
            return []
        try:
            addresses = await self.target.resolve(self._lookup)
        except OSError as exc:
            logger.warning("peers %s: lookup failed (%s): none reached", self.target.address, exc)
            return []
        self._keep_only(addresses)
        marked = (*metadata, (FORWARDED_BY, self.instance))
        replies = await asyncio.gather(*(self._one(a, call, marked) for a in addresses))
        return [reply for reply in replies if reply is not None]

    async def _one(
        self,
        address: str,
        call: Callable[[grpc.aio.Channel, Metadata], Awaitable[T]],
        metadata: Metadata,
    ) -> T | None:
        try:
            return await asyncio.wait_for(call(self._channel(address), metadata), self._timeout_s)
        except TimeoutError:
            logger.warning(
                "peer %s: no answer in %.1fs: taken to hold nothing", address, self._timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _UNREACHED:
                logger.warning(
                    "peer %s: unreachable (%s): taken to hold nothing", address, exc.code().name
                )
            else:
                logger.error(
                    "peer %s refused a call passed on: %s: %s",
                    address,
                    exc.code().name,
                    exc.details(),
                )
        return None

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._dialing.channel(address, CHANNEL_OPTIONS)
        return channel

    def _keep_only(self, addresses: Collection[str]) -> None:
        """Close the channels of peers no longer listed (a Pod replaced)."""
        for address in [a for a in self._channels if a not in addresses]:
            task = asyncio.create_task(self._channels.pop(address).close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def _orchestrator(channel: grpc.aio.Channel) -> orchestrator_pb2_grpc.OrchestratorStub:
    return orchestrator_pb2_grpc.OrchestratorStub(channel)
