"""Continuous batching on the one thread that owns the model (worker.py), for any
model runner.

Each step (nano-vllm's ``schedule`` → ``run`` → ``postprocess``):

1. retire what finished or was cancelled since the last step (its consumer stopped
   iterating): its rows are freed;
2. admit waiting requests in arrival order while the batch has room
   (``max_batch_size``) and the runner's memory takes them (``runner.fits``); the
   head of the queue waits rather than be overtaken;
3. plan: every admitted request still reading its prompt advances one chunk (the
   shortest remaining prompt sets it, so a short prompt finishes in its first step
   and a long one cannot hold it back; the oldest always advances, so none
   starves); every running request that is ready takes one step;
4. run: where the runner mixes, prefill and decode rows are one forward (one read
   of the weights); otherwise the prefill runs first and its first tokens leave
   before the decode forward (a request's time to first token is its prefill, not
   prefill + a step), which those whose prompt it completed join;
5. hand each request its events: one wake of the event loop per step (LoopPost).

An idle scheduler gathers newcomers for a moment first (arrivals.py), so that
requests sent together share their prefill. A request whose prompt completes in a
mixed step decodes from the next one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic

import torch

from services.engines.scheduler.arrivals import Arrivals
from services.engines.scheduler.contract import ModelRunner, Outbox, R, Step, StepTaken
from services.engines.scheduler.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    # Prompt positions one prefill forward may take, all rows together. None: no
    # chunking, every prompt read whole in its first step (a runner that prefills a
    # prompt at once; its size was bounded once, at intake, by max_prompt_tokens).
    prefill_tokens: int | None = None
    # An idle scheduler waits up to this long after a first arrival for the requests
    # announced with it (``expect``) or arriving close behind it, so that they share
    # their prefill.
    gather_s: float = 0.0


class Scheduler(Generic[R]):
    def __init__(
        self,
        runner: ModelRunner[R],
        limits: Limits,
        name: str = "scheduler",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.runner = runner
        self._clock = clock
        self._arrivals = Arrivals(limits.gather_s, clock)
        self.waiting: deque[R] = deque()
        self.prefilling: list[R] = []
        self.running: list[R] = []
        self._watchers: list[Callable[[StepTaken], None]] = []
        self._worker: Worker[R, list[R]] = Worker(
            name,
            "the engine",
            take=self._take,
            run=self._pass,
            fail=self._failed,
            end=self._fail_all,
            due=self._has_work,
        )

    # -- from the event loop ----------------------------------------------------

    def expect(self) -> None:
        """A request was checked and is on its way to ``submit`` (a stage checks each
        request just before it runs it): what makes gathering worth a wait."""
        with self._worker.changing():
            self._arrivals.expect()

    def submit(self, request: R) -> None:
        with self._worker.changing():
            self._worker.submit(request)
            self._arrivals.arrived()

    def wake(self) -> None:
        """Something changed (a cancel, a talker's input): look at it now."""
        self._worker.wake()

    def watch(self, watcher: Callable[[StepTaken], None]) -> Callable[[], None]:
        """Call ``watcher`` on the model thread after each forward (metrics, tests);
        returns what stops it."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher)

    def close(self, timeout_s: float = 10.0) -> None:
        self._worker.close(timeout_s)

    # -- the model thread ------------------------------------------------------

    def _take(self, arrived: list[R]) -> list[list[R]]:
        """With the lock held: an idle scheduler first gathers newcomers, up to
        ``gather_s``, while more arrivals are likely (arrivals.py; a lone request waits
        ``ARRIVAL_GAP_S`` at most); then this pass takes every arrival."""
        if not self._busy():
            deadline = self._clock() + self.limits.gather_s
            while not self._worker.closed and len(arrived) < self.limits.max_batch_size:
                left = self._arrivals.wait_until(deadline) - self._clock()
                if left <= 0:
                    break
                self._worker.wait(left)
        taken = arrived[:]
        arrived.clear()
        return [taken]

    def _pass(self, arrived: list[R]) -> None:
        """The arrivals join the line; one step."""
        self.waiting.extend(arrived)
        with torch.inference_mode():
            self.step()

    def _failed(self, _: list[R], error: Exception) -> None:
        """A model error: this batch (and whatever waits) fails; the scheduler serves on."""
        logger.exception("a step failed; failing %d requests", self._count())
        self._fail_all(self._worker.drain(), error)

    def _busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def _has_work(self) -> bool:
        """Whether a step would do anything: a request waiting, a ready one, or one
        gone (to retire)."""
        return bool(
            self.waiting or self.prefilling or any(r.ready or _gone(r) for r in self.running)
        )

    def _count(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def step(self) -> None:
        self._retire()
        self._admit()
        prefill = [r for r in self.prefilling if r.ready]
        ready = [r for r in self.running if r.ready]
        if not (prefill or ready):
            return
        chunk = self._chunk_width([r.remaining_prompt for r in prefill])
        if prefill and ready and self.runner.mixes:
            self._run(Step(prefill, chunk, ready))
            return
        if prefill:
            self._run(Step(prefill=prefill, chunk=chunk))
            # those whose prompt just completed decode in this step's decode forward
            ready = [r for r in self.running if r.ready]
        if ready:
            self._run(Step(decode=ready))

    def _run(self, step: Step[R]) -> None:
        outbox = self.runner.run(step)
        if self._watchers:
            taken = StepTaken(
                tuple(r.request_id for r in step.prefill),
                step.chunk,
                tuple(r.request_id for r in step.decode),
            )
            for watcher in list(self._watchers):
                watcher(taken)
        done = [r for r in step.prefill if r.remaining_prompt == 0 and not r.finished]
        if done:
            self.prefilling = [r for r in self.prefilling if r.remaining_prompt > 0]
            self.running.extend(done)
        _deliver(outbox)

    def _retire(self) -> None:
        self.waiting = deque(r for r in self.waiting if not _gone(r))
        # ``cancelled`` flips on the event loop at any time: decide who leaves once,
        # so the runner and the scheduler drop the same rows.
        gone = [r for r in (*self.prefilling, *self.running) if _gone(r)]
        if gone:
            self.runner.free(gone)
            leaving = set(map(id, gone))
            self.prefilling = [r for r in self.prefilling if id(r) not in leaving]
            self.running = [r for r in self.running if id(r) not in leaving]

    def _admit(self) -> None:
        admitted: list[R] = []
        while self.waiting and self._fits([*admitted, self.waiting[0]]):
            request = self.waiting.popleft()
            request.admitted = self._clock()
            admitted.append(request)
        if admitted:
            self.runner.admit(admitted)
            self.prefilling += admitted

    def _fits(self, joining: Sequence[R]) -> bool:
        members = [*self.prefilling, *self.running, *joining]
        return len(members) <= self.limits.max_batch_size and self.runner.fits(members)

    def _chunk_width(self, remaining: list[int]) -> int:
        """Positions of this prefill step: the shortest remaining prompt, stretched to
        take along others almost as short (bounded padding), within the budget."""
        if not remaining:
            return 0
        if self.limits.prefill_tokens is None:
            return max(remaining)  # whole prompts
        shortest = min(remaining)
        slack = max(16, shortest // 4)
        width = max(r for r in remaining if r <= shortest + slack)
        budget = max(16, self.limits.prefill_tokens // len(remaining))
        return max(1, min(width, budget))

    def _fail_all(self, pending: list[R], error: BaseException) -> None:
        """Every request held or ``pending`` fails with ``error``; the runner drops its rows."""
        self.waiting.extend(pending)
        for request in [*self.waiting, *self.prefilling, *self.running]:
            request.finished = True
            request.deliver(error)
        self.waiting.clear()
        self.prefilling, self.running = [], []
        self.runner.reset()


def _deliver(outbox: Outbox[R]) -> None:
    """Hand each request its events."""
    for request, events in outbox.items():
        request.deliver(events)


def _gone(request: R) -> bool:
    return request.finished or request.cancelled
