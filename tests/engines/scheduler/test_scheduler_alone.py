"""The scheduler with no model at all: a runner that only counts (each decode step
says the request's next number). What batching decides is seen in what each
request is handed and in each forward the scheduler asked for: admission in arrival
order within the batch and memory limits, prompt chunks within the prefill budget,
prefill and decode mixed only for a runner that mixes, cancelled requests freed, and
a failed step failing its batch while the scheduler serves on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from services.engines.base import FinishOutput, TokenOutput
from services.engines.scheduler import (
    Delivery,
    Handed,
    Limits,
    Outbox,
    Scheduler,
    Step,
    StepTaken,
)

TIMEOUT_S = 30.0


@dataclass(eq=False)
class Counting:
    """A request: ``prompt`` positions to read, then ``tokens`` numbers to say."""

    request_id: str
    prompt: int
    tokens: int
    submitted: float = 0.0
    admitted: float = 0.0
    cancelled: bool = False
    finished: bool = False
    prefilled: int = 0
    said: list[int] = field(default_factory=list)
    got: list[Handed] = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def deliver(self) -> Callable[[Delivery], None]:
        return self._deliver

    def _deliver(self, delivery: Delivery) -> None:
        if isinstance(delivery, BaseException):
            self.error = delivery
            self.done.set()
            return
        self.got.extend(delivery)
        if any(isinstance(e, FinishOutput) for e in delivery):
            self.done.set()

    @property
    def remaining_prompt(self) -> int:
        return self.prompt - self.prefilled

    @property
    def ready(self) -> bool:
        return True

    @property
    def numbers(self) -> list[int]:
        return [t for e in self.got if isinstance(e, TokenOutput) for t in e.token_ids]


class CountingRunner:
    """Rows are request ids; memory holds ``capacity`` prompt positions in all."""

    def __init__(self, mixes: bool = True, capacity: int = 1 << 30) -> None:
        self.mixes = mixes
        self.capacity = capacity
        self.rows: set[str] = set()
        self.freed: list[str] = []
        self.resets = 0
        self.fail_next = False

    def fits(self, members: Sequence[Counting]) -> bool:
        return sum(r.prompt + r.tokens for r in members) <= self.capacity

    def admit(self, admitted: Sequence[Counting]) -> None:
        self.rows.update(r.request_id for r in admitted)

    def run(self, step: Step[Counting]) -> Outbox[Counting]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the forward failed")
        assert {r.request_id for r in (*step.prefill, *step.decode)} <= self.rows
        time.sleep(0.0002)  # a forward lets go of the GIL, as torch's do
        out: Outbox[Counting] = {}
        for r in step.prefill:
            r.prefilled += min(step.chunk, r.remaining_prompt)
        for r in step.decode:
            r.said.append(len(r.said))
            events: list[Handed] = [TokenOutput((r.said[-1],), str(r.said[-1]))]
            if len(r.said) == r.tokens:
                r.finished = True
                events.append(FinishOutput("length", r.prompt, r.tokens))
            out[r] = events
        return out

    def free(self, gone: Sequence[Counting]) -> None:
        for r in gone:
            self.rows.discard(r.request_id)
            self.freed.append(r.request_id)

    def reset(self) -> None:
        self.resets += 1
        self.rows.clear()


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[Scheduler[Counting], list[StepTaken]]]]:
    made: list[Scheduler[Counting]] = []

    def build(
        runner: CountingRunner, batch: int = 8, prefill_tokens: int | None = 1 << 30
    ) -> tuple[Scheduler[Counting], list[StepTaken]]:
        scheduler: Scheduler[Counting] = Scheduler(runner, Limits(batch, prefill_tokens))
        steps: list[StepTaken] = []
        scheduler.watch(steps.append)
        made.append(scheduler)
        return scheduler, steps

    yield build
    for scheduler in made:
        scheduler.close()


def finish(*requests: Counting) -> None:
    for r in requests:
        assert r.done.wait(TIMEOUT_S), f"{r.request_id} never ended"


def until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_every_request_is_handed_its_own_numbers_in_order(make) -> None:
    scheduler, steps = make(CountingRunner(), batch=3)
    requests = [Counting(f"r{i}", prompt=4 + i, tokens=3 + i) for i in range(7)]
    for r in requests:
        scheduler.submit(r)
    finish(*requests)
    for r in requests:
        assert r.error is None and r.numbers == list(range(r.tokens))
        assert r.got[-1] == FinishOutput("length", r.prompt, r.tokens)
    # Never more than the batch in one forward; every request was in some forward.
    assert all(len(s.prefill) + len(s.decode) <= 3 for s in steps)
    assert {i for s in steps for i in (*s.prefill, *s.decode)} == {r.request_id for r in requests}


def test_admission_keeps_arrival_order_when_memory_is_short(make) -> None:
    runner = CountingRunner(capacity=30)
    scheduler, steps = make(runner, batch=8)
    big = Counting("big", prompt=10, tokens=10)  # 20 of 30
    huge = Counting("huge", prompt=10, tokens=10)  # does not fit beside big
    small = Counting("small", prompt=1, tokens=1)  # would fit, but arrived after huge
    for r in (big, huge, small):
        scheduler.submit(r)
    finish(big, huge, small)
    first_seen = {}
    for n, s in enumerate(steps):
        for i in (*s.prefill, *s.decode):
            first_seen.setdefault(i, n)
    # The head of the queue waits rather than be overtaken.
    assert first_seen["big"] < first_seen["huge"] <= first_seen["small"]
    assert all(not ({"big", "huge"} <= {*s.prefill, *s.decode}) for s in steps)


def test_prompts_advance_in_chunks_within_the_prefill_budget(make) -> None:
    scheduler, steps = make(CountingRunner(), batch=4, prefill_tokens=64)
    short, long = Counting("short", prompt=5, tokens=2), Counting("long", prompt=100, tokens=2)
    scheduler.submit(long)
    scheduler.submit(short)
    finish(short, long)
    prefills = [s for s in steps if s.prefill]
    # Every prefill forward takes at most the budget, all rows together.
    assert all(s.chunk * len(s.prefill) <= max(64, 16 * len(s.prefill)) for s in prefills)
    chunks = {i: sum(s.chunk for s in prefills if i in s.prefill) for i in ("short", "long")}
    assert chunks["long"] >= 100 and len([s for s in prefills if "long" in s.prefill]) > 1


def test_without_a_prefill_budget_every_prompt_is_read_whole_in_one_step(make) -> None:
    """Limits(prefill_tokens=None): the omni runners prefill a prompt at once."""
    scheduler, steps = make(CountingRunner(), batch=4, prefill_tokens=None)
    requests = [Counting(f"r{n}", prompt=n, tokens=2) for n in (5, 100, 3000)]
    for r in requests:
        scheduler.submit(r)
    finish(*requests)
    for r in requests:
        (step,) = [s for s in steps if r.request_id in s.prefill]
        assert step.chunk >= r.prompt and r.numbers == [0, 1]


def test_only_a_runner_that_mixes_gets_prefill_and_decode_in_one_forward(make) -> None:
    for mixes in (True, False):
        scheduler, steps = make(CountingRunner(mixes=mixes), batch=4)
        first = Counting("first", prompt=2, tokens=100_000)  # decodes until cancelled
        scheduler.submit(first)
        until(lambda r=first: bool(r.numbers))
        second = Counting("second", prompt=2, tokens=2)
        scheduler.submit(second)
        finish(second)
        first.cancelled = True
        scheduler.wake()
        joined = [s for s in list(steps) if "second" in s.prefill]
        assert joined and all(bool(s.decode) is mixes for s in joined), joined


def test_a_cancelled_request_is_freed_and_the_others_go_on(make) -> None:
    runner = CountingRunner()
    scheduler, _steps = make(runner, batch=4)
    stays, leaves = Counting("stays", prompt=2, tokens=200), Counting("leaves", 2, 10_000)
    scheduler.submit(stays)
    scheduler.submit(leaves)
    until(lambda: len(leaves.numbers) >= 3)
    leaves.cancelled = True
    scheduler.wake()
    finish(stays)
    assert stays.numbers == list(range(200)) and stays.error is None
    until(lambda: "leaves" in runner.freed)
    assert not leaves.done.is_set()  # a cancelled request is dropped, not ended
    assert len(leaves.numbers) < 10_000


def test_a_cancel_landing_while_others_are_freed_frees_it_too(make) -> None:
    """The event loop sets ``cancelled`` at any moment, also while the scheduler is
    freeing others: the runner and the scheduler must still drop the same rows (a
    row dropped by one only left the text runner stepping rows it no longer had)."""
    first, second = Counting("first", 2, 10_000), Counting("second", 2, 10_000)
    stays = Counting("stays", prompt=2, tokens=300)

    class Racing(CountingRunner):
        def free(self, gone: Sequence[Counting]) -> None:
            super().free(gone)
            if first in gone:
                second.cancelled = True  # lands between the two halves of retiring

    runner = Racing()
    scheduler, steps = make(runner, batch=4)
    for r in (first, second, stays):
        scheduler.submit(r)
    until(lambda: len(second.numbers) >= 3)
    first.cancelled = True
    scheduler.wake()
    finish(stays)
    assert stays.numbers == list(range(300)) and stays.error is None
    until(lambda: "second" in runner.freed)
    assert runner.rows == set()
    late = [s for s in steps if "second" in s.decode][-1]
    assert steps.index(late) < len(steps) - 1  # it stopped decoding before the end


def test_a_failed_step_fails_its_batch_and_the_scheduler_serves_on(make) -> None:
    runner = CountingRunner()
    scheduler, _steps = make(runner, batch=4)
    runner.fail_next = True
    victims = [Counting(f"v{i}", prompt=3, tokens=5) for i in range(2)]
    for r in victims:
        scheduler.submit(r)
    finish(*victims)
    # The first forward failed: every request in it ends with the error, none
    # half-served (one submitted after it may have been served whole).
    assert isinstance(victims[0].error, RuntimeError) and not victims[0].numbers
    assert all(isinstance(r.error, RuntimeError) or r.numbers == list(range(5)) for r in victims)
    assert runner.resets == 1
    after = Counting("after", prompt=3, tokens=5)
    scheduler.submit(after)
    finish(after)
    assert after.error is None and after.numbers == list(range(5))
