"""Handing items from a model thread to an event loop: one wake for many, and a wake
that does not hand the loop the GIL.

``loop.call_soon_threadsafe`` wakes the loop through its self-pipe on every call, and
the pipe write releases the GIL: the woken loop thread takes it, and the model thread
waits until the loop has handled the item and gone back to its selector. py-spy on a
stage decoding one request: the model thread spent 7 % of its samples in that write,
and a decode step of 8 requests made 8 such wakes.

Here items posted while an earlier wake is pending ride along with it, so a step's
deliveries cost one wake; and on Linux the wake is a write to an eventfd the loop
watches, made while holding the GIL (ctypes.PyDLL). The model thread carries on to
its next step; the loop takes the GIL when the model thread next releases it, in
the step's C kernels, and handles the items alongside them. Elsewhere (no eventfd,
a loop without add_reader) it is ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

_ONE = ctypes.c_uint64(1)


def _gil_holding_write() -> Callable[[int, Any, int], int] | None:
    """libc's write(2), called without releasing the GIL; None where unavailable."""
    if not hasattr(os, "eventfd"):
        return None
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write  # type: ignore[no-any-return]


_WRITE = _gil_holding_write()


class LoopPost:
    """Calls ``put(item)`` on the loop's thread for each item posted from any thread,
    in the order posted, waking the loop once for those posted before it runs.
    Create it on the loop's thread (``loop_post``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop's reader holds this: no cycle
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []
        self._fd: int | None = None
        if _WRITE is not None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                loop.add_reader(fd, self._woken)
            except (NotImplementedError, RuntimeError):
                os.close(fd)
            else:
                self._fd = fd
                weakref.finalize(self, os.close, fd)

    def post(self, put: Callable[[Any], None], item: Any) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():  # no one is listening
            return
        with self._lock:
            wake = not self._pending
            self._pending.append((put, item))
        if not wake:
            return
        if self._fd is not None and _WRITE is not None:
            _WRITE(self._fd, ctypes.byref(_ONE), 8)
            return
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed meanwhile
            with self._lock:
                self._pending.clear()

    def _woken(self) -> None:
        assert self._fd is not None
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass
        self._drain()

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for put, item in pending:
            put(item)


_POSTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopPost] = weakref.WeakKeyDictionary()
_POSTS_LOCK = threading.Lock()


def loop_post(loop: asyncio.AbstractEventLoop) -> LoopPost:
    """The one LoopPost of ``loop`` (call it on the loop's thread)."""
    with _POSTS_LOCK:
        post = _POSTS.get(loop)
        if post is None:
            post = _POSTS[loop] = LoopPost(loop)
        return post
