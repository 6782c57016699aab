"""The stage's serving core, transport-agnostic: admits requests, drives the
engine, segments its output and reports one final event per request.

Every request ends in exactly one CompletedOut or ErrorOut; an error ends that
request only, never the stage.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from services.engines.base import (
    Engine,
    EngineEvent,
    EngineRequest,
    FinishOutput,
    ProgressOutput,
    TensorOutput,
    TokenOutput,
)
from services.mesh.errors import Cancelled, InvalidArgument, OmniError, Unavailable
from services.stage.config import StageConfig
from services.stage.events import CompletedOut, ErrorOut, ProgressOut, SegmentOut, StageEvent
from services.stage.intake import Intake
from services.stage.segmenter import Segmenter

logger = logging.getLogger(__name__)

Sink = Callable[[StageEvent], Awaitable[None]]


@dataclass
class _Running:
    task: asyncio.Task[None]
    cancel_reason: str = ""
    cancel_error: OmniError | None = None


class StageRuntime:
    def __init__(
        self, config: StageConfig, engine: Engine, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.engine = engine
        self._clock = clock
        # The engine batches: it decides which requests share a step (max_batch_size
        # of them, within its KV plan) and queues the rest itself. The intake only
        # bounds what the stage holds at once, so that enough requests reach the
        # engine to form batches.
        runtime = config.runtime
        self._intake = Intake(runtime.max_batch_size + runtime.max_queue_size, 0)
        self._requests: dict[str, _Running] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.ready = False
        self.draining = False
        self.not_ready_reason = "stage is starting"

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def prepare(self, request: EngineRequest) -> EngineRequest:
        """Stage defaults filled in and the engine's own checks passed."""
        prepared = replace(request, params=self.config.apply_defaults(request.params))
        self.engine.check(prepared)
        return prepared

    def admit(
        self,
        request: EngineRequest,
        sink: Sink,
        more: AsyncIterator[EngineRequest] | None = None,
    ) -> None:
        """Start ``request``; raises OmniError (nothing started) when it is refused.

        ``more`` streams further input windows of the same request (prepared),
        each run through the engine as it arrives, their output continuing the
        request's segment sequence (``runtime.streaming_input``).
        """
        name = self.config.name
        if self.draining:
            raise Unavailable(f"stage {name} is draining")
        if not self.ready:
            raise Unavailable(f"stage {name} is not ready: {self.not_ready_reason}")
        if request.request_id in self._requests:
            raise InvalidArgument(
                f"submit.request_id: {request.request_id!r} is already in flight on stage {name}",
                field="submit.request_id",
            )
        first = self.prepare(request)
        task = asyncio.create_task(self._run(first, more, sink), name=f"request-{first.request_id}")
        self._requests[first.request_id] = _Running(task)
        self._idle.clear()
        task.add_done_callback(functools.partial(self._forget, first.request_id))

    def cancel(
        self,
        request_id: str,
        reason: str = "cancelled by the client",
        error: OmniError | None = None,
    ) -> bool:
        """Stop a request at its next step; it reports CANCELLED, or ``error``."""
        running = self._requests.get(request_id)
        if running is None:
            return False
        running.cancel_reason = reason
        running.cancel_error = error
        running.task.cancel()
        return True

    def _forget(self, request_id: str, _task: asyncio.Task[None] | None = None) -> None:
        self._requests.pop(request_id, None)
        if not self._requests:
            self._idle.set()

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work and wait up to ``grace_s`` for in-flight requests;
        cancel what is left. True when everything finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except TimeoutError:
            for request_id in list(self._requests):
                self.cancel(request_id, "stage shut down before the request finished")
            await self._idle.wait()
            return False

    async def _run(
        self, first: EngineRequest, more: AsyncIterator[EngineRequest] | None, sink: Sink
    ) -> None:
        rid = first.request_id
        submitted = self._clock()
        cfg = self.config.segmenting
        segmenter = Segmenter(cfg.max_segment_tokens, cfg.min_flush_interval_ms / 1e3, self._clock)
        done = _Done(submitted)
        try:
            async with self._intake.slot(rid):
                started = self._clock()
                await self._generate(first, sink, segmenter, done)
                if more is not None:
                    async for window in more:
                        await self._generate(window, sink, segmenter, done)
                await self._flush(rid, segmenter, sink, done, is_last=True)
            now = self._clock()
            await sink(
                CompletedOut(
                    rid,
                    done.reason,
                    done.prompt_tokens,
                    done.completion_tokens,
                    queue_ms=(started - submitted) * 1e3 + done.queue_ms,
                    time_to_first_ms=(done.first_at - submitted) * 1e3,
                    total_ms=(now - submitted) * 1e3,
                )
            )
        except asyncio.CancelledError:
            running = self._requests.get(rid)
            if running is None or not running.cancel_reason:
                raise  # the stream itself went away: nobody to tell
            logger.info("stage %s request %s: %s", self.config.name, rid, running.cancel_reason)
            error = running.cancel_error or Cancelled(f"request {rid}: {running.cancel_reason}")
            await sink(ErrorOut(rid, error))
        except OmniError as exc:
            logger.info("stage %s request %s failed: %s", self.config.name, rid, exc.message)
            await sink(ErrorOut(rid, exc))
        except Exception as exc:
            logger.exception("stage %s request %s: engine error", self.config.name, rid)
            error = OmniError(f"request {rid}: internal error in the {self.config.engine} engine")
            error.__cause__ = exc
            await sink(ErrorOut(rid, error))

    async def _flush(
        self, rid: str, segmenter: Segmenter, sink: Sink, done: _Done, is_last: bool = False
    ) -> None:
        segment = segmenter.flush(is_last)
        if segment is not None:
            if segment.sequence == 0:
                done.first_at = self._clock()
            await sink(SegmentOut(rid, segment))

    async def _generate(
        self, request: EngineRequest, sink: Sink, segmenter: Segmenter, done: _Done
    ) -> None:
        """Run one (window of a) request through the engine; the last flush is the caller's."""
        rid = request.request_id
        events: AsyncGenerator[EngineEvent, None] = self.engine.generate(request)
        pending: asyncio.Future[EngineEvent] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(events))
                finished, _ = await asyncio.wait({pending}, timeout=segmenter.due_in())
                if not finished:
                    await self._flush(rid, segmenter, sink, done)  # min_flush_interval passed
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
                        await self._flush(rid, segmenter, sink, done)
                elif isinstance(event, ProgressOutput):
                    await self._flush(rid, segmenter, sink, done)
                    await sink(ProgressOut(rid, event))
                elif isinstance(event, TensorOutput):
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
