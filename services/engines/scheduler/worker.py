"""The one thread that owns a model, written once: it sleeps until woken, takes what
was submitted, runs passes over it, and on close fails what it never took.

Its owners keep only what one pass does: the scheduler (scheduler.py: the arrivals
join its line, then one step), code2wav's chunks (qwen_omni/decode_batch.py: one
forward per shape) and the diffusers pipeline (diffusers/batch.py: one call per batch
that can share it). The owner hands it five functions:

- ``take(pending)``, the lock held: this pass's batches, taken out of ``pending``
  (the list the worker keeps; it may ``wait`` for more to arrive first);
- ``run(batch)``, without the lock: one pass over a batch;
- ``fail(batch, error)``: ``run(batch)`` raised; that batch's work fails with it and
  the worker goes on with the next;
- ``end(pending, error)``: the worker closed; what was submitted and never taken
  fails with ``error`` ("… closed");
- ``due()``, the lock held (optional): whether a pass has work though nothing new was
  submitted (a scheduler's running requests).

A model error never kills the thread; only ``close`` ends it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")  # what is submitted
B = TypeVar("B")  # what one pass runs


def _never() -> bool:
    return False


class Worker(Generic[T, B]):
    def __init__(
        self,
        name: str,
        what: str,
        *,
        take: Callable[[list[T]], Sequence[B]],
        run: Callable[[B], None],
        fail: Callable[[B, Exception], None],
        end: Callable[[list[T], RuntimeError], None],
        due: Callable[[], bool] = _never,
    ) -> None:
        self._what = what  # in errors: "{what} is closed", "{what} closed"
        self._take, self._run, self._fail, self._end, self._due = take, run, fail, end, due
        self._cond = threading.Condition()
        self._pending: list[T] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- from any thread ----------------------------------------------------------

    def submit(self, item: T) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._what} is closed")
            self._pending.append(item)
            self._cond.notify()

    def withdraw(self, item: T) -> bool:
        """Take ``item`` back; False when a pass has taken it already."""
        with self._cond:
            if item in self._pending:
                self._pending.remove(item)
                return True
            return False

    @contextmanager
    def changing(self) -> Iterator[None]:
        """The lock held for a change to what ``take`` or ``due`` read; the thread is
        woken after it."""
        with self._cond:
            yield
            self._cond.notify()

    @property
    def pending(self) -> int:
        """How many wait to be taken (metrics, tests)."""
        with self._cond:
            return len(self._pending)

    def wake(self) -> None:
        """Something ``due`` reads changed: look at it now."""
        with self._cond:
            self._cond.notify()

    def close(self, timeout_s: float | None = 10.0) -> None:
        """Ends the thread once its pass in hand is done (waiting up to ``timeout_s``;
        None: as long as it takes); what it never took fails ("… closed")."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # -- inside take (the lock held) -----------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def wait(self, timeout_s: float) -> None:
        """Sleep until woken (an arrival, a close) or ``timeout_s`` has passed."""
        self._cond.wait(timeout_s)

    def drain(self) -> list[T]:
        """What was submitted and not taken, taken now (an owner failing all it holds)."""
        with self._cond:
            pending, self._pending = self._pending, []
            return pending

    # -- the thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._pending or self._due()):
                    self._cond.wait()
                if self._closed:
                    break
                batches = self._take(self._pending)
            for batch in batches:
                try:
                    self._run(batch)
                except Exception as exc:  # a model error: this batch fails, the rest go on
                    self._fail(batch, exc)
        self._end(self.drain(), RuntimeError(f"{self._what} closed"))
