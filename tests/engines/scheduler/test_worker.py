"""The model-thread worker (scheduler/worker.py) alone, with no model: it runs a pass
when woken, an exception in a pass fails that pass's work and the worker goes on,
and close ends the thread and fails what it never took with a clear error."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from services.engines.scheduler import Worker
from tests.engines.scheduler.test_scheduler_alone import TIMEOUT_S, until


class Doubling:
    """A worker's owner: each pass takes every number waiting as one batch and hands
    back its doubles; a batch holding ``bad`` raises; a pass may be held at ``gate``."""

    def __init__(self, bad: int = -1) -> None:
        self.bad = bad
        self.gate = threading.Event()
        self.gate.set()
        self.in_pass = threading.Event()
        self.batches: list[list[int]] = []
        self.done: dict[int, int | BaseException] = {}
        self.ended: list[int] = []
        self.threads: set[str] = set()
        self.worker: Worker[int, list[int]] = Worker(
            "doubling", "the doubler", take=self.take, run=self.run, fail=self.fail, end=self.end
        )

    def take(self, pending: list[int]) -> list[list[int]]:
        batch = pending[:]
        pending.clear()
        return [batch]

    def run(self, batch: list[int]) -> None:
        self.threads.add(threading.current_thread().name)
        self.in_pass.set()
        assert self.gate.wait(TIMEOUT_S)
        self.batches.append(batch)
        if self.bad in batch:
            raise ValueError(f"cannot double {self.bad}")
        self.done.update({n: 2 * n for n in batch})

    def fail(self, batch: list[int], error: Exception) -> None:
        self.done.update(dict.fromkeys(batch, error))

    def end(self, pending: list[int], error: RuntimeError) -> None:
        self.ended += pending
        self.done.update(dict.fromkeys(pending, error))


@pytest.fixture
def owner() -> Iterator[Doubling]:
    made = Doubling(bad=13)
    yield made
    made.worker.close()


def test_each_submission_wakes_a_pass_on_the_worker_thread(owner: Doubling) -> None:
    for n in (1, 2, 3):
        owner.worker.submit(n)
        until(lambda n=n: n in owner.done)  # type: ignore[misc]
    assert owner.done == {1: 2, 2: 4, 3: 6}
    assert owner.threads == {"doubling"}


def test_what_arrives_during_a_pass_is_taken_by_the_next(owner: Doubling) -> None:
    owner.gate.clear()
    owner.worker.submit(1)
    assert owner.in_pass.wait(TIMEOUT_S)
    for n in (2, 3, 4):
        owner.worker.submit(n)
    assert owner.worker.pending == 3
    assert owner.worker.withdraw(3) and not owner.worker.withdraw(1)  # 1 is in its pass
    owner.gate.set()
    until(lambda: 4 in owner.done)
    assert owner.batches == [[1], [2, 4]] and 3 not in owner.done


def test_a_pass_that_raises_fails_its_work_and_the_worker_goes_on(owner: Doubling) -> None:
    owner.gate.clear()
    owner.worker.submit(5)
    assert owner.in_pass.wait(TIMEOUT_S)
    owner.worker.submit(13)
    owner.worker.submit(6)  # shares the failing pass
    owner.gate.set()
    until(lambda: 6 in owner.done)
    owner.worker.submit(7)
    until(lambda: 7 in owner.done)
    assert owner.done[5] == 10 and owner.done[7] == 14
    assert isinstance(owner.done[13], ValueError) and owner.done[13] is owner.done[6]
    assert owner.batches == [[5], [13, 6], [7]]


def test_close_ends_the_thread_and_fails_what_was_never_taken(owner: Doubling) -> None:
    owner.gate.clear()
    owner.worker.submit(1)
    assert owner.in_pass.wait(TIMEOUT_S)
    owner.worker.submit(2)
    owner.worker.submit(3)
    closing = threading.Thread(target=owner.worker.close)
    closing.start()
    until(lambda: owner.worker.closed)
    owner.gate.set()  # the pass in hand ends as it would have
    closing.join(TIMEOUT_S)
    assert not closing.is_alive()
    assert not any(t.name == "doubling" for t in threading.enumerate())
    assert owner.done[1] == 2 and owner.ended == [2, 3]
    for n in (2, 3):
        error = owner.done[n]
        assert isinstance(error, RuntimeError) and str(error) == "the doubler closed"
    with pytest.raises(RuntimeError, match="the doubler is closed"):
        owner.worker.submit(4)


def test_an_owner_with_work_of_its_own_is_woken_by_wake() -> None:
    """``due``: a pass runs with nothing submitted while the owner says it has work
    (a scheduler's running requests), and ``wake`` makes the worker look again."""
    more = threading.Event()
    passes: list[int] = []

    def run(_: None) -> None:
        more.clear()
        passes.append(len(passes))

    worker: Worker[int, None] = Worker(
        "due",
        "the owner",
        take=lambda pending: [None],
        run=run,
        fail=lambda _, error: None,
        end=lambda pending, error: None,
        due=more.is_set,
    )
    try:
        for n in range(1, 4):
            more.set()
            worker.wake()
            until(lambda n=n: len(passes) == n)  # type: ignore[misc]
    finally:
        worker.close()
    assert passes == [0, 1, 2]
