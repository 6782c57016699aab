"""Handing items from a model thread to an event loop with one wake for many.

``loop.call_soon_threadsafe`` wakes the loop through its self-pipe on every call. A
decode step of 8 requests made 8 such wakes, and each one hands the GIL back and
forth between the model thread and the woken loop thread (py-spy on a stage: the
model thread waited in the self-pipe write for 4-8 % of its samples). Here items
posted while an earlier wake is still pending ride along with it: a step's
deliveries cost one wake.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any


class LoopPost:
    """Calls ``put(item)`` on ``loop``'s thread for each item posted from any thread,
    in the order posted, waking the loop once for those posted before it runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []

    def post(self, put: Callable[[Any], None], item: Any) -> None:
        with self._lock:
            wake = not self._pending
            self._pending.append((put, item))
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the event loop has closed: nobody is listening
                with self._lock:
                    self._pending.clear()

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for put, item in pending:
            put(item)


_POSTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopPost] = weakref.WeakKeyDictionary()
_POSTS_LOCK = threading.Lock()


def loop_post(loop: asyncio.AbstractEventLoop) -> LoopPost:
    """The one LoopPost of ``loop``."""
    with _POSTS_LOCK:
        post = _POSTS.get(loop)
        if post is None:
            post = _POSTS[loop] = LoopPost(loop)
        return post
