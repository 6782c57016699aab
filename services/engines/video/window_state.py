"""Per-request window state kept between ``generate`` calls.

Under ``runtime.streaming_input`` a request's windows arrive one ``generate``
call at a time, and window t+1 must continue window t's KV caches, input
projection and decoder. The state lives here, keyed by request id. The engine
is not told when a request ends (the runtime calls nothing after its last
window), so a state is dropped when its request fails or is cancelled
mid-call, when it has been idle for ``idle_s``, or, oldest idle first, when
``capacity`` requests already hold one. A later window of a request whose
state was dropped is refused (FAILED_PRECONDITION), never run on a fresh state.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.engines.video.model import StreamState
from services.mesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    state: StreamState
    used_at: float
    busy: bool = False


class StreamStates:
    def __init__(
        self, capacity: int, idle_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._capacity = capacity
        self._idle_s = idle_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()  # the last few thousand

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def acquire(self, request_id: str, new: Callable[[], StreamState]) -> StreamState:
        """The request's state (a new one for its first window), held until ``release``."""
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(request_id)
        if entry is None and request_id in self._dropped:
            raise FailedPrecondition(
                f"request {request_id}: its stream state was dropped (idle or evicted); "
                "its windows cannot be continued"
            )
        if entry is None:
            if len(self._entries) >= self._capacity and not self._evict_one():
                raise ResourceExhausted(
                    f"request {request_id}: the video engine already holds "
                    f"{self._capacity} streams in flight"
                )
            entry = self._entries[request_id] = _Entry(new(), now)
        elif entry.busy:
            raise InvalidArgument(
                f"request {request_id}: a window of it is still being upscaled",
                field="submit.request_id",
            )
        entry.busy = True
        entry.used_at = now
        return entry.state

    def release(self, request_id: str, *, keep: bool) -> None:
        """After a call: ``keep`` the state for the next window, or drop it (the call
        did not finish, so the state is no longer that of a window border)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if keep:
            entry.busy = False
            entry.used_at = self._clock()
        else:
            self._drop(request_id)

    def forget(self, request_id: str) -> None:
        """The request is over: drop its state (nothing to refuse later)."""
        self._entries.pop(request_id, None)

    def clear(self) -> None:
        self._entries.clear()

    def _expire(self, now: float) -> None:
        for request_id, entry in list(self._entries.items()):
            if not entry.busy and now - entry.used_at > self._idle_s:
                idle = now - entry.used_at
                logger.info("video stream %s: idle for %.0f s, state dropped", request_id, idle)
                self._drop(request_id)

    def _evict_one(self) -> bool:
        idle = [(e.used_at, rid) for rid, e in self._entries.items() if not e.busy]
        if not idle:
            return False
        _, request_id = min(idle)
        logger.info("video stream %s: state dropped to make room", request_id)
        self._drop(request_id)
        return True

    def _drop(self, request_id: str) -> None:
        del self._entries[request_id]
        self._dropped[request_id] = None
        while len(self._dropped) > 4096:
            self._dropped.popitem(last=False)
