"""KEDA's external-scaler service (protos/externalscaler), answering per stage.

A ScaledObject's ``external`` (or ``external-push``) trigger names a stage in its
metadata (``trigger``); the metric is that stage's demand (``demand``): requests
waiting for it plus those in flight at its replicas. KEDA's HPA sets the stage's
replicas to ceil(metric / targetPerReplica) within the ScaledObject's bounds;
IsActive (any demand at all) decides between minReplicaCount and more.

It is served on the orchestrator's own port, next to omni.v1.Orchestrator: KEDA
dials the Service clients already reach, over the same TLS, and no second port
needs opening, probing or a NetworkPolicy rule. It needs no client token (KEDA
sends none): it tells a caller only how many requests each stage has now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from orchestrator.server.peers import Peers, forwarded_by
from orchestrator.server.scaling.demand import StageDemand
from orchestrator.server.scaling.trigger import Trigger, read_trigger
from services.mesh.errors import InvalidArgument, OmniError, abort_rpc
from services.mesh.pb.externalscaler import externalscaler_pb2 as pb
from services.mesh.pb.externalscaler import externalscaler_pb2_grpc

logger = logging.getLogger(__name__)

SCALER = pb.DESCRIPTOR.services_by_name["ExternalScaler"]
# StreamIsActive looks at the demand this often and sends only a change: the counts
# move with every request on the hot path, which stays free of callbacks, and a
# stream sends at most one message per look, however busy the stage.
POLL_S = 0.25


class ExternalScaler(externalscaler_pb2_grpc.ExternalScalerServicer):
    """``peers``: the other orchestrators; a stage's demand is theirs and this one's
    (each counts the requests it carries). A call a peer passed on is answered
    with this one's alone, and one this orchestrator passed on itself with 0."""

    def __init__(
        self, demand: StageDemand, poll_s: float = POLL_S, peers: Peers | None = None
    ) -> None:
        self.demand = demand
        self._peers = peers
        self._poll_s = poll_s
        self.streams = 0  # StreamIsActive calls open now
        self._closing = asyncio.Event()

    async def _trigger(
        self, ref: pb.ScaledObjectRef, context: grpc.aio.ServicerContext, *, needs_target: bool
    ) -> Trigger:
        try:
            return read_trigger(ref.scalerMetadata, self.demand.stages, needs_target=needs_target)
        except OmniError as exc:
            logger.info("ScaledObject %s/%s: %s", ref.namespace, ref.name, exc.message)
            await abort_rpc(context, exc)

    async def _requests(
        self, ref: pb.ScaledObjectRef, trigger: Trigger, context: grpc.aio.ServicerContext
    ) -> float:
        """The stage's demand: here, plus every peer's for a call from outside."""
        metadata = context.invocation_metadata()
        if self._peers is not None and self._peers.is_self(metadata):
            return 0.0  # this orchestrator asking itself (a headless Service lists it)
        here = float(self.demand.of(trigger.stage).requests)
        if self._peers is None or not self._peers or forwarded_by(metadata) is not None:
            return here
        asked = pb.GetMetricsRequest(scaledObjectRef=ref, metricName=trigger.metric_name)
        return here + await self._peers.demand(asked)

    async def _active(
        self, ref: pb.ScaledObjectRef, trigger: Trigger, context: grpc.aio.ServicerContext
    ) -> bool:
        return await self._requests(ref, trigger, context) > 0

    async def IsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.IsActiveResponse:
        trigger = await self._trigger(request, context, needs_target=False)
        return pb.IsActiveResponse(result=await self._active(request, trigger, context))

    async def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IsActiveResponse]:
        """The answer now, then each change, until the caller goes (its cancel ends
        the wait) or the orchestrator stops (``close``: the stream ends OK, and KEDA
        dials again, reaching another orchestrator behind the Service)."""
        trigger = await self._trigger(request, context, needs_target=False)
        self.streams += 1
        try:
            sent: bool | None = None
            while not self._closing.is_set():
                active = await self._active(request, trigger, context)
                if active != sent:
                    yield pb.IsActiveResponse(result=active)
                    sent = active
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):
                        await self._closing.wait()
        finally:
            self.streams -= 1

    def close(self) -> None:
        """End every StreamIsActive now (the orchestrator is stopping)."""
        self._closing.set()

    async def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricSpecResponse:
        trigger = await self._trigger(request, context, needs_target=True)
        assert trigger.target is not None  # needs_target
        spec = pb.MetricSpec(
            metricName=trigger.metric_name,
            # KEDA reads the float where it is set; the integer for older KEDAs.
            targetSize=max(1, round(trigger.target)),
            targetSizeFloat=trigger.target,
        )
        return pb.GetMetricSpecResponse(metricSpecs=[spec])

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricsResponse:
        trigger = await self._trigger(request.scaledObjectRef, context, needs_target=False)
        name = request.metricName
        if name and name != trigger.metric_name:
            wrong = InvalidArgument(
                f"metricName: {name!r} is not this trigger's metric ({trigger.metric_name!r},"
                " from GetMetricSpec)",
                field="metricName",
            )
            await abort_rpc(context, wrong)
        requests = await self._requests(request.scaledObjectRef, trigger, context)
        value = pb.MetricValue(
            metricName=trigger.metric_name,
            metricValue=round(requests),
            metricValueFloat=requests,
        )
        return pb.GetMetricsResponse(metricValues=[value])
