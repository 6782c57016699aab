"""Requests in flight across the mesh: starts each one's flow, aborts them,
holds new ones while generation is paused (``pause``) or a stage they need is
not ready (a bounded wait: ``gate``), and fails the ones a lost stage held.

Every request ends in exactly one Done on its sink, whatever happens: its stages'
outcome, an abort, a lost stage, the orchestrator stopping (UNAVAILABLE).

A request id is its caller's: requests are kept by (caller, id), so one caller's
ids never collide with, wait on or reveal another's, and the stages see a
mesh-unique id of the orchestrator's making (``stage_id``: a prefix unique to
this router, then the client's id, cut to the length a stage takes), which
never leaves the mesh: every event a client gets carries its own id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from orchestrator.server.pipeline import PipelineConfig
from orchestrator.server.requests import observe
from orchestrator.server.requests.errors import NotStarted
from orchestrator.server.requests.flow import Describe, RequestFlow
from orchestrator.server.requests.pause import Pause
from orchestrator.server.requests.sink import EventSink
from orchestrator.server.requests.stage_mux import StageStreams
from orchestrator.server.requests.topology import Topology, unoffered
from orchestrator.server.stages.replicas import ReplicaSet
from services.mesh import errors, media_types
from services.mesh.data.chunks import CHUNK_BYTES
from services.mesh.data.ref_reader import RefReader
from services.mesh.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    OmniError,
    Unavailable,
)
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.rpc.request_ids import MAX_REQUEST_ID
from services.mesh.rpc.stage_client import StageClient
from services.mesh.security import ANONYMOUS, Principal

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (the caller's name, its request id)


class Gate(Protocol):
    """Whether the stages a request needs can take it (``gate.StageGate``)."""

    async def until_ready(self, stages: Sequence[str], deadline: float | None) -> None:
        """Return once they can; raise NotStarted naming one that cannot."""
        ...


@dataclass
class RouterEntry:
    """The router's record of one request in flight."""

    flow: RequestFlow
    task: asyncio.Task[None]
    owner: Principal  # who started it: only it (or an admin) may abort it
    # Why the request was stopped from outside (abort, stage loss, a bad input), if it was.
    stopped_by: OmniError | None = None
    stopped_at: str = ""  # the stage to name in the Done
    # Its task has taken its first step. One cancelled before that never runs its
    # body (no Done, no clean-up), so a stop then is left for the task to find.
    started: bool = False
    silent: bool = False  # its client is gone: it ends without a Done


class Router:
    def __init__(
        self,
        pipeline: PipelineConfig,
        clients: Mapping[str, StageClient],
        replicas: Mapping[str, ReplicaSet],
        gate: Gate,
        clock: Callable[[], float] = time.monotonic,
        *,
        describe: Describe = lambda _stage: None,
        refs: RefReader | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        max_pause_s: float = 300.0,
    ) -> None:
        self._topology = Topology.of(pipeline)
        self.generation = Pause(max_pause_s, clock)  # PauseGeneration's hold on new requests
        self._clients = clients
        self.streams = StageStreams(replicas)  # every request's streams to the replicas
        self._gate = gate
        self._clock = clock
        self._describe = describe
        self._refs = refs
        self._chunk_bytes = chunk_bytes
        self._background: set[asyncio.Task[None]] = set()
        # What recent requests moved: wire bytes read from each stage, by request id.
        self.recent_bytes: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._running: dict[Key, RouterEntry] = {}
        # Stage ids: unique to this router (several orchestrators may share a stage).
        self._tag = secrets.token_hex(4)
        self._serial = itertools.count(1)
        self._stopping = False
        self.completed = 0
        # Seconds upstream reads waited on each edge's high watermark ("a->b"), summed.
        self.blocked_s: dict[str, float] = {}

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @property
    def stopping(self) -> bool:
        """``stop()`` has begun: no new request, and those in flight are ending."""
        return self._stopping

    def start(
        self,
        request_id: str,
        entry_inputs: AsyncIterator[stage_pb2.Submit],
        stage_params: Mapping[str, stage_pb2.GenerationParams],
        sink: EventSink,
        *,
        owner: Principal = ANONYMOUS,
        timeout_s: float | None = None,
        id_field: str = "request_id",
        alone: str = "",
        affinity: str = "",
        outputs: Sequence[str] = (),
        outputs_field: str = "outputs",
    ) -> None:
        """Start a request for ``owner``; its events and then its Done go to ``sink``.
        ``timeout_s``: the client's deadline, enforced per request and passed on to the stages;
        ``id_field``: where the client's message holds the id (named if refused);
        ``alone``: a stage that runs the request by itself (a known one), "" for the pipeline;
        ``affinity``: its conversation's key (stages with affinity keep it on one replica);
        ``outputs``: the outputs the client wants (empty: all; only what they need runs),
        named as ``outputs_field`` when refused."""
        key = (owner.name, request_id)
        if self._stopping:
            raise Unavailable("the orchestrator is stopping: it takes no new requests")
        if key in self._running:
            # Only the caller's own ids can collide: this tells it nothing of others'.
            raise InvalidArgument(
                f"{id_field}: {request_id!r} is already in flight", field=id_field
            )
        topology = self._topology.alone(alone) if alone else self._topology
        topology = topology.serving(outputs, outputs_field)
        prefix = f"{self._tag}{next(self._serial):x}-"
        flow = RequestFlow(
            request_id,
            topology,
            self._clients,
            self.streams,
            sink,
            entry_inputs,
            stage_params,
            self._clock,
            stage_id=(prefix + request_id)[:MAX_REQUEST_ID],
            describe=self._describe,
            refs=self._refs,
            chunk_bytes=self._chunk_bytes,
            deadline=None if timeout_s is None else time.monotonic() + timeout_s,
            affinity=affinity,
        )
        task = asyncio.create_task(self._run(key, flow, sink), name=f"request-{flow.stage_id}")
        self._running[key] = RouterEntry(flow, task, owner)

    async def _run(self, key: Key, flow: RequestFlow, sink: EventSink) -> None:
        with observe.request_span(flow.request_id):
            await self._drive(key, flow, sink)

    async def _drive(self, key: Key, flow: RequestFlow, sink: EventSink) -> None:
        rid = flow.request_id
        began = self._clock()
        client_blocked = sink.blocked_s
        entry = self._running[key]
        entry.started = True
        try:
            if entry.silent or entry.stopped_by is not None:
                raise asyncio.CancelledError  # stopped before it began: as if now
            await self.generation.wait()
            await self._gate.until_ready(flow.topology.order, flow.deadline)
            self._check_transforms(flow.topology)
            done = await flow.run()
            for edge, seconds in flow.blocked_s.items():
                self.blocked_s[edge] = self.blocked_s.get(edge, 0.0) + seconds
            waited = sink.blocked_s - client_blocked  # a slow client held the stages back
            self.blocked_s["client"] = self.blocked_s.get("client", 0.0) + waited
            flow.blocked_s["client"] = waited
        except NotStarted as refused:
            done = errors.done(rid, refused, refused.stage)
        except asyncio.CancelledError:
            running = self._running.get(key)
            if running is None or running.stopped_by is None or running.silent:
                raise  # the client went away: nobody to tell
            done = errors.done(rid, running.stopped_by, running.stopped_at)
        finally:
            self._running.pop(key, None)
            self._after(flow)
        done.total_ms = (self._clock() - began) * 1e3
        self.completed += 1
        observe.finished(done, flow.blocked_s)
        observe.spoken(flow.audio)
        level = logging.DEBUG if done.code == 0 else logging.WARNING
        logger.log(
            level,
            "request %s: %s in %.0f ms %s",
            flow.stage_id,
            done.code_name or "OK",
            done.total_ms,
            done.message,
        )
        await sink.put(orchestrator_pb2.GenerateEvent(done=done))

    def refuse_kinds(
        self, inputs: stage_pb2.StageInputs, prefix: str = "inputs", alone: str = ""
    ) -> None:
        """A content part the entry stage (``alone``: the stage a request runs alone)
        does not take (its Describe's ``accepts``) is refused here, in the stage's
        words, before its media travel on; the stage checks again (it may not be
        described yet, or have restarted)."""
        entry = alone or self._topology.entry
        description = self._describe(entry)
        if description is not None and description.accepts:
            media_types.refuse_kinds(inputs.messages, description.accepts, entry, prefix)

    def _check_transforms(self, topology: Topology) -> None:
        """Every edge's transform must be one its consuming stage offers (the server
        fails such a stage at start-up; this covers a request that raced it)."""
        for stage in topology.order:
            for edge in topology.children[stage]:
                problem = unoffered(edge, self._describe(edge.to))
                if problem is not None:
                    raise NotStarted(edge.to, FailedPrecondition(problem))

    def _after(self, flow: RequestFlow) -> None:
        self.recent_bytes[flow.request_id] = dict(flow.bytes_in)
        while len(self.recent_bytes) > 256:
            self.recent_bytes.popitem(last=False)
        if flow.shared_from:  # in the background: the client need not wait for it
            task = asyncio.create_task(flow.release_shared())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def abort(
        self, request_ids: list[str], caller: Principal = ANONYMOUS
    ) -> tuple[list[str], list[str]]:
        """Abort the requests ``caller`` may abort: its own (an admin: everyone's of
        that id). Another caller's request is reported not found: its id tells nothing."""
        aborted: list[str] = []
        not_found: list[str] = []
        for rid in request_ids:
            keys = [(caller.name, rid)]
            if caller.admin:
                keys = [key for key in self._running if key[1] == rid]
            stopped = [k for k in keys if self._fail(k, Cancelled(f"request {rid} was aborted"))]
            (aborted if stopped else not_found).append(rid)
        return aborted, not_found

    def cancel_silently(self, request_id: str, owner: Principal = ANONYMOUS) -> None:
        """The client is gone: stop everything the request holds, report nothing."""
        running = self._running.get((owner.name, request_id))
        if running is not None:
            running.silent = True
            if running.started:
                running.task.cancel()

    def stage_lost(self, stage: str, message: str) -> int:
        """Fail at once every request a lost stage holds; returns how many."""
        lost = [key for key, r in self._running.items() if stage in r.flow.active_stages]
        for key in lost:
            self._fail(key, Unavailable(message), stage)
        return len(lost)

    def fail(self, request_id: str, error: OmniError, owner: Principal = ANONYMOUS) -> bool:
        """End ``owner``'s running request with ``error`` (its one Done says so);
        False if it has none of that id."""
        return self._fail((owner.name, request_id), error)

    def _fail(self, key: Key, error: OmniError, stage: str = "") -> bool:
        running = self._running.get(key)
        if running is None:
            return False
        if running.stopped_by is None:  # the first reason is the one reported
            running.stopped_by, running.stopped_at = error, stage
        if running.started:
            running.task.cancel()
        return True

    def stage_id(self, request_id: str, owner: Principal = ANONYMOUS) -> str | None:
        """What the stages know ``owner``'s request by, while it is in flight."""
        running = self._running.get((owner.name, request_id))
        return None if running is None else running.flow.stage_id

    def __contains__(self, request_id: str) -> bool:
        """Whether any caller has a request of this id in flight."""
        return any(rid == request_id for _owner, rid in self._running)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Refuse new requests; end every request in flight UNAVAILABLE, each with
        its Done, given ``grace_s`` to reach its client's stream (one that is not
        read is cut off after it); then close the streams to the stages."""
        self._stopping = True
        tasks = [r.task for r in self._running.values()]
        for key in list(self._running):
            self._fail(key, Unavailable("the orchestrator is stopping: the request did not finish"))
        if tasks:
            _done, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.streams.close()
