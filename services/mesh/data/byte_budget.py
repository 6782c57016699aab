"""One budget for request input a process holds in memory: a cap per stream
and a cap per process.

What a client sends is held before it is used up: chunks of a tensor whose
message has not come yet, the windows of a request that waits for its last one,
the inputs of a request while it runs. Each stream charges its own
``StreamAccount``, and every account charges the process's ``InputBudget``, so
many streams together cannot hold more than the process allows. A charge that
would pass either cap is refused with RESOURCE_EXHAUSTED naming the input,
before anything is kept; every charge is given back when what it paid for is
gone (a chunk resolved, a request ended on any path, a stream closed).

The stage charges chunks, windows and running requests' inputs
(services/stage/serving/generate_rpc.py); the orchestrator charges its clients'
chunks, and both servers every unary request message while it is read and held
(services/mesh/rpc/reads.py). Charges come from the event loop and from threads
that decode inputs, so the counters are guarded by one lock. ``on_release`` hears
of every byte given back that held memory (the orchestrator then returns freed
memory to the system after a burst: services/mesh/data/malloc.py); a reservation
handed back unused (``release(..., freed=False)``) is bookkeeping, not memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from services.mesh.errors import ResourceExhausted


class InputBudget:
    """The process's cap; ``held`` is what every stream holds together. ``key`` and
    each account's ``key`` name the settings in refusals."""

    def __init__(
        self,
        limit: int,
        key: str = "runtime.max_process_input_bytes",
        *,
        on_release: Callable[[int], None] | None = None,
    ) -> None:
        self.limit = limit
        self.key = key
        self.held = 0
        self._lock = threading.Lock()
        self._on_release = on_release

    def account(
        self, limit: int, key: str = "runtime.max_input_bytes", holder: str = "stream"
    ) -> StreamAccount:
        """A new stream's account (or a ``holder``'s: a caller's, say), capped at
        ``limit`` bytes."""
        return StreamAccount(self, limit, key, holder)

    def _take(self, account: StreamAccount, nbytes: int, field: str) -> None:
        with self._lock:
            if account.held + nbytes > account.limit:
                raise ResourceExhausted(
                    f"{field}: {nbytes} more input bytes would pass this {account.holder}'s "
                    f"cap; it holds {account.held} of at most {account.limit} ({account.key})",
                    field=field,
                )
            if self.held + nbytes > self.limit:
                raise ResourceExhausted(
                    f"{field}: {nbytes} more input bytes would pass this process's cap; its "
                    f"streams hold {self.held} of at most {self.limit} ({self.key})",
                    field=field,
                )
            account.held += nbytes
            self.held += nbytes

    def _give(self, account: StreamAccount, nbytes: int, freed: bool = True) -> None:
        with self._lock:
            nbytes = min(nbytes, account.held)
            account.held -= nbytes
            self.held -= nbytes
        if freed and self._on_release is not None and nbytes > 0:
            self._on_release(nbytes)


class StreamAccount:
    """What one Generate stream holds; ``close`` gives all of it back."""

    def __init__(self, budget: InputBudget, limit: int, key: str, holder: str = "stream") -> None:
        self.limit = limit
        self.key = key
        self.holder = holder
        self.held = 0
        self._budget = budget

    def reserve(self, nbytes: int, field: str) -> None:
        """Charge ``nbytes`` or raise ResourceExhausted naming ``field`` (nothing charged)."""
        self._budget._take(self, nbytes, field)

    def release(self, nbytes: int, *, freed: bool = True) -> None:
        """Give ``nbytes`` back; ``freed=False``: they were reserved but never held
        memory (the unused part of a reservation), so no memory was freed."""
        self._budget._give(self, nbytes, freed=freed)

    def hold(self) -> Hold:
        """A request's share of this account, given back at once when it ends."""
        return Hold(self)

    def close(self) -> None:
        if self.held:
            self._budget._give(self, self.held)


class Hold:
    """The input bytes one request holds: its buffered windows, then its whole input
    while it runs. ``release`` (when the request leaves the registry) gives all back."""

    def __init__(self, account: StreamAccount) -> None:
        self.held = 0
        self._account = account

    def add(self, nbytes: int, field: str) -> None:
        self._account.reserve(nbytes, field)
        self.held += nbytes

    def release(self) -> None:
        held, self.held = self.held, 0
        if held:
            self._account.release(held)
