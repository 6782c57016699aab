"""The one registry of requests in flight in this stage process.

A request is in flight from its first Submit to its final event (Completed or
Error). Its record holds everything any part of the stage knows about it: the
stream it came on (whose emitter sends its events), the consumer its output tensors are
for, its transform and parameters, the input windows that have come so far,
the feed of a streaming-input request, and the task that runs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from services.engines.base import EnginePlan, SamplingParams
from services.mesh.data.byte_budget import Hold
from services.mesh.errors import OmniError
from services.mesh.pb.omni.v1 import tensor_pb2
from services.stage.serving.events import StageEvent
from services.stage.serving.inputs import InputWindows


class Emitter(Protocol):
    """The output side of one Generate stream: where its requests' events go."""

    async def emit(self, record: RequestRecord, event: StageEvent) -> None: ...


class InputFeed:
    """The input windows of one streaming-input request, bounded so a client that
    sends faster than the engine consumes is held back by flow control. Unbounded
    (``depth=0``) for a request under credit on a shared stream: there a full feed
    would stop the stream's reader for every request; what it holds is then bounded
    by what the producing stage emits for the request (an input credit would bound
    it tighter)."""

    def __init__(self, depth: int = 4) -> None:
        self._queue: asyncio.Queue[EnginePlan | None] = asyncio.Queue(depth)
        self._abandoned = False

    async def put(self, plan: EnginePlan | None) -> None:
        if not self._abandoned:
            await self._queue.put(plan)

    async def close(self) -> None:
        """No more windows: the request ends after those already queued."""
        await self.put(None)

    def abandon(self) -> None:
        """The request has ended: nobody reads on, so a blocked ``put`` must not wait."""
        self._abandoned = True
        while not self._queue.empty():
            self._queue.get_nowait()

    async def windows(self) -> AsyncIterator[EnginePlan]:
        while (plan := await self._queue.get()) is not None:
            yield plan


class OutputCredit:
    """How many outputs a request may still send before it waits for a Credit
    (per-request flow control, ``Submit.credit``). While it waits, the request's
    engine outputs are not pulled: it pauses, and the stream's others go on."""

    def __init__(self, outputs: int) -> None:
        self._left = outputs
        self._granted = asyncio.Event()

    @property
    def left(self) -> int:
        return self._left

    def grant(self, outputs: int) -> None:
        self._left += outputs
        if self._left > 0:
            self._granted.set()

    async def spend(self) -> None:
        """Take one output's credit, waiting for a grant when there is none."""
        while self._left <= 0:
            self._granted.clear()
            await self._granted.wait()
        self._left -= 1


@dataclass(eq=False)
class RequestRecord:
    """One request in this stage, from its first Submit to its final event."""

    request_id: str
    emitter: Emitter  # the Generate stream it came on (its owner): its events go out there
    consumer: tensor_pb2.NodeIdentity | None  # where its output tensors will be opened
    transform: str
    params: SamplingParams
    windows: InputWindows
    # Its input bytes on the stream's budget, given back when it leaves the registry.
    held: Hold | None = None
    feed: InputFeed | None = None  # streaming input: later windows go here
    task: asyncio.Task[None] | None = None  # None until its input is admitted
    running: bool = False  # its task has taken its first step (the runtime's ``end``)
    input_done: bool = False  # its last window (is_last) has come
    # Set by cancel(): why, and the error its final event carries.
    cancel_reason: str = ""
    cancel_error: OmniError | None = None
    final: bool = False  # its final event is on its way: nothing may end it again
    # Its trace context from the orchestrator (Submit.trace_context), for its spans.
    trace_context: Mapping[str, str] = field(default_factory=dict)
    credit: OutputCredit | None = None  # None: no per-request flow control
    deadline: asyncio.TimerHandle | None = None  # ends it at Submit.timeout_ms


class InFlightRequests:
    def __init__(self) -> None:
        self._records: dict[str, RequestRecord] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return sum(1 for r in self._records.values() if r.task is not None)

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._records.values()))

    def live(self, request_id: str) -> RequestRecord | None:
        """The request ``request_id`` unless it has ended (or is sending its final event)."""
        record = self._records.get(request_id)
        return None if record is None or record.final else record

    def add(self, record: RequestRecord) -> None:
        assert self.live(record.request_id) is None, f"{record.request_id} is in flight"
        self._records[record.request_id] = record

    def started(self, record: RequestRecord, task: asyncio.Task[None]) -> None:
        record.task = task
        self._idle.clear()

    def remove(self, record: RequestRecord) -> None:
        # Every path a request ends by comes through here: its input budget goes back.
        if record.held is not None:
            record.held.release()
        if record.deadline is not None:
            record.deadline.cancel()
        if self._records.get(record.request_id) is record:
            del self._records[record.request_id]
        if not any(r.task is not None for r in self._records.values()):
            self._idle.set()

    def of_stream(self, emitter: Emitter) -> list[RequestRecord]:
        """The requests that came on the stream ``emitter`` sends for."""
        return [r for r in self._records.values() if r.emitter is emitter]

    @property
    def idle(self) -> bool:
        """No request is running."""
        return self._idle.is_set()

    async def wait_idle(self) -> None:
        """Until no request is running."""
        await self._idle.wait()
