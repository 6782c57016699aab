"""The stage's serving core, transport-agnostic: starts requests, drives the
engine, segments its output and reports one final event per request.

Every request ends in exactly one CompletedOut or ErrorOut; an error ends that
request only, never the stage. The one exception is ``EngineDead``: the engine
is gone, so every request in flight ends UNAVAILABLE, new ones are refused, and
``died`` is set for the server to fail the stage (FAILED, NOT_SERVING, exit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from services.engines.base import (
    Engine,
    EngineEvent,
    EnginePlan,
    EngineRequest,
    FinishOutput,
    ProgressOutput,
    TensorOutput,
    TokenOutput,
)
from services.engines.capabilities import HoldsInputBack, KeepsRequestState, planned
from services.mesh.data.byte_budget import InputBudget
from services.mesh.data.malloc import FreedMemory
from services.mesh.errors import Cancelled, EngineDead, NotServing, OmniError, Unavailable
from services.stage.config import StageConfig
from services.stage.serving import observe
from services.stage.serving.admission import Admission
from services.stage.serving.events import (
    CompletedOut,
    ErrorOut,
    ProgressOut,
    SegmentOut,
    StageEvent,
)
from services.stage.serving.requests import Emitter, InFlightRequests, RequestRecord
from services.stage.serving.segmenter import Segmenter

logger = logging.getLogger(__name__)


class StageRuntime:
    def __init__(
        self, config: StageConfig, engine: Engine, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.engine = engine
        self.requests = InFlightRequests()
        # Input held in memory by every stream of this process (services.mesh.data.byte_budget);
        # once a burst of it has been given back, so is its memory, to the system.
        self.freed = FreedMemory()
        self.budget = InputBudget(
            config.runtime.max_process_input_bytes, on_release=self.freed.released
        )
        self._clock = clock
        runtime = config.runtime
        self._admission = Admission(config.name, runtime.max_batch_size, runtime.max_queue_size)
        self.ready = False
        self.draining = False
        self.not_ready_reason = "stage is starting"
        self.death: EngineDead | None = None
        self.died = asyncio.Event()

    @property
    def in_flight(self) -> int:
        """Requests running or queued for a run slot (not those still sending windows)."""
        return len(self.requests)

    async def prepare(self, request: EngineRequest) -> EnginePlan:
        """The engine's plan for ``request``: its checks passed (with the stage's
        defaults resolved by the engine: services/engines/defaults.py), its prompt
        tokenized once, for ``generate`` to run.

        In a thread: an engine's check may tokenize or template a prompt, which
        takes CPU in proportion to it; the event loop (health, every other
        request's events) must keep turning meanwhile."""
        return await asyncio.to_thread(planned, self.engine, request)

    def check_open(self) -> None:
        """Refuse new work while the stage cannot serve it."""
        name = self.config.name
        if self.death is not None:
            raise NotServing(f"stage {name}: the engine died ({self.death.message})")
        if self.draining:
            raise NotServing(f"stage {name} is draining")
        if not self.ready:
            raise NotServing(f"stage {name} is not ready: {self.not_ready_reason}")

    async def start(
        self,
        record: RequestRecord,
        request: EngineRequest,
        more: AsyncIterator[EnginePlan] | None = None,
    ) -> None:
        """Run ``record``'s request; raises OmniError (nothing started) when it is refused.

        ``more`` streams further input windows of the same request (planned),
        each run through the engine as it arrives, their output continuing the
        request's segment sequence (``runtime.streaming_input``).
        """
        self.check_open()
        first = await self.prepare(request)
        if self.requests.live(record.request_id) is not record:
            return  # ended while its check ran (Abort, the stage draining): nothing to start
        self.check_open()
        task = asyncio.create_task(
            self._run(record, first, more), name=f"request-{record.request_id}"
        )
        self.requests.started(record, task)

    async def end(self, record: RequestRecord, error: OmniError) -> None:
        """End ``record`` with ``error`` as its one final event, stopping its work."""
        if record.final:
            return  # it has its final event already
        if record.task is None or not record.running:
            # Still receiving windows, or its task has not taken its first step: a
            # task cancelled then never runs its body, so its final event is sent here.
            if record.task is not None:
                record.task.cancel()
            record.final = True
            if record.feed is not None:
                record.feed.abandon()
            self.requests.remove(record)
            await record.emitter.emit(record, ErrorOut(record.request_id, error))
            return
        record.cancel_reason = error.message
        record.cancel_error = error
        record.task.cancel()

    async def cancel(self, request_id: str, reason: str) -> bool:
        """Cancel ``request_id`` whichever stream it came on (the Abort RPC)."""
        record = self.requests.live(request_id)
        if record is None:
            return False
        await self.end(record, Cancelled(f"request {request_id}: {reason}"))
        return True

    def drop_stream(self, emitter: Emitter) -> None:
        """The stream is gone: its requests stop with nobody left to tell."""
        for record in self.requests.of_stream(emitter):
            if record.task is not None:
                record.task.cancel()
            if not record.running:  # its body will not run (see ``end``): gone now
                self.requests.remove(record)

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work and wait up to ``grace_s`` for running requests; end
        what is left UNAVAILABLE. True when everything finished in time."""
        self.draining = True
        if self.requests.idle:
            return True
        try:
            await asyncio.wait_for(self.requests.wait_idle(), grace_s)
            return True
        except TimeoutError:
            left = Unavailable(f"stage {self.config.name} shut down before the request finished")
            for record in self.requests:
                await self.end(record, left)
            await self.requests.wait_idle()
            return False

    async def _run(
        self, record: RequestRecord, first: EnginePlan, more: AsyncIterator[EnginePlan] | None
    ) -> None:
        record.running = True
        try:
            with observe.request(self.config.name, record.request_id, record.trace_context):
                final = await self._outcome(record, first, more)
            record.final = True
            await record.emitter.emit(record, final)
        finally:
            if record.feed is not None:
                record.feed.abandon()
            if isinstance(self.engine, KeepsRequestState):
                self.engine.release(record.request_id)
            self.requests.remove(record)

    async def _outcome(
        self, record: RequestRecord, first: EnginePlan, more: AsyncIterator[EnginePlan] | None
    ) -> StageEvent:
        """The request run to its end; its final event (CancelledError: nobody to tell)."""
        rid = record.request_id
        stage = self.config.name
        submitted = self._clock()
        cfg = self.config.segmenting
        segmenter = Segmenter(
            cfg.max_segment_tokens,
            cfg.min_flush_interval_ms / 1e3,
            self._clock,
            first_tokens=cfg.first_segment_tokens,
        )
        done = _Done(submitted)
        try:
            with observe.queued(stage):
                self._admission.enter(rid)
            try:
                started = self._clock()
                with observe.running(stage):
                    await self._generate(record, first, segmenter, done)
                    if more is not None:
                        async for window in more:
                            await self._generate(record, window, segmenter, done)
                    if isinstance(self.engine, HoldsInputBack):
                        rest = self.engine.input_ended(rid)
                        if rest is not None:
                            await self._generate(record, rest, segmenter, done)
                    await self._flush(record, segmenter, done, is_last=True)
            finally:
                self._admission.leave()
            return CompletedOut(
                rid,
                done.reason,
                done.prompt_tokens,
                done.completion_tokens,
                queue_ms=(started - submitted) * 1e3 + done.queue_ms,
                time_to_first_ms=(done.first_at - submitted) * 1e3,
                total_ms=(self._clock() - submitted) * 1e3,
            )
        except asyncio.CancelledError:
            if record.cancel_error is None:
                raise  # the stream itself went away: nobody to tell
            logger.info("stage %s request %s: %s", stage, rid, record.cancel_reason)
            return ErrorOut(rid, record.cancel_error)
        except EngineDead as exc:
            await self._engine_died(record, exc)
            return ErrorOut(rid, exc)
        except OmniError as exc:
            logger.info("stage %s request %s failed: %s", stage, rid, exc.message)
            return ErrorOut(rid, exc)
        except Exception as exc:
            logger.exception("stage %s request %s: engine error", stage, rid)
            error = OmniError(f"request {rid}: internal error in the {self.config.engine} engine")
            error.__cause__ = exc
            return ErrorOut(rid, error)

    async def _engine_died(self, record: RequestRecord, exc: EngineDead) -> None:
        if self.death is not None:
            return
        logger.error("stage %s: the engine died: %s", self.config.name, exc.message)
        self.death = exc
        self.ready = False
        self.not_ready_reason = f"the engine died ({exc.message})"
        gone = EngineDead(f"stage {self.config.name}: the engine died; the stage restarts")
        for other in self.requests:
            if other is not record:
                await self.end(other, gone)
        self.died.set()

    async def _flush(
        self, record: RequestRecord, segmenter: Segmenter, done: _Done, is_last: bool = False
    ) -> None:
        segment = segmenter.flush(is_last)
        if segment is not None:
            if segment.sequence == 0:
                done.first_at = self._clock()
            await record.emitter.emit(record, SegmentOut(record.request_id, segment))

    async def _generate(
        self, record: RequestRecord, plan: EnginePlan, segmenter: Segmenter, done: _Done
    ) -> None:
        """Run one (window of a) request through the engine; the last flush is the caller's."""
        emit = record.emitter.emit
        events: AsyncGenerator[EngineEvent, None] = self.engine.generate(plan)
        pending: asyncio.Future[EngineEvent] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(events))
                finished, _ = await asyncio.wait({pending}, timeout=segmenter.due_in())
                if not finished:
                    await self._flush(record, segmenter, done)  # min_flush_interval passed
                    continue
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    break
                finally:
                    if pending.done():
                        pending = None
                if isinstance(event, TokenOutput):
                    if segmenter.add(event):
                        await self._flush(record, segmenter, done)
                elif isinstance(event, ProgressOutput):
                    await self._flush(record, segmenter, done)
                    await emit(record, ProgressOut(record.request_id, event))
                elif isinstance(event, TensorOutput):
                    if segmenter.holds(event):  # a later window's: never over an earlier one
                        await self._flush(record, segmenter, done)
                    segmenter.add_outputs(event)
                elif isinstance(event, FinishOutput):
                    done.reason = event.reason
                    done.prompt_tokens += event.prompt_tokens
                    done.completion_tokens += event.completion_tokens
                    done.queue_ms += event.queue_ms
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await events.aclose()


@dataclass
class _Done:
    first_at: float
    reason: str = "done"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0  # inside the engine, waiting for a place in a batch
