"""What a fetch reports and obeys: the result, the download hook, a rate-limited
progress feed, and the cancel switch a stopping stage flips."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.mesh.errors import InitFailed


@dataclass(frozen=True)
class FetchResult:
    """Where the model now lies on local disk.

    ``source`` is the source as given, with any URL credentials and query string
    removed (presigned URLs carry secrets that must not reach logs or InitStatus).
    """

    path: Path
    nbytes: int  # bytes fetched (an archive's own size, not what it unpacks to)
    cache_hit: bool
    source: str
    verified: bool = False  # its bytes matched the #sha256= the source pinned


class DownloadHook(Protocol):
    """Receives DOWNLOAD_START / PROGRESS / DONE; called from the fetching thread."""

    def start(self, source: str, bytes_total: int | None) -> None: ...

    def progress(self, bytes_done: int, bytes_total: int | None) -> None: ...

    def done(self, result: FetchResult, duration_s: float) -> None: ...

    def preparing(self, what: str) -> None:
        """Local work on the fetched bytes starts now (unpacking an archive)."""
        ...


class FetchCancelled(InitFailed):
    """The stage is stopping: the fetch stopped, its partial file kept for a resume."""


class FetchCancel:
    """Set from the event loop when the stage stops; a fetching thread stops at
    its next read (``check``), and a read blocked on a silent server is woken
    by the callbacks registered with ``on_cancel``."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            with contextlib.suppress(OSError):
                callback()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True at once when cancelled."""
        return self._event.wait(timeout_s)

    def check(self, what: str) -> None:
        if self._event.is_set():
            raise FetchCancelled(f"{what} stopped: the stage is shutting down")

    @contextlib.contextmanager
    def on_cancel(self, callback: Callable[[], None]) -> Iterator[None]:
        with self._lock:
            self._callbacks.append(callback)
            already = self._event.is_set()
        if already:
            with contextlib.suppress(OSError):
                callback()
        try:
            yield
        finally:
            with self._lock:
                self._callbacks.remove(callback)


class ProgressFeed:
    """Forwards byte progress to a hook at most once every ``interval_s``.

    Thread-safe: huggingface_hub reports from several download threads at once.
    """

    def __init__(
        self,
        hook: DownloadHook,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hook = hook
        self._interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()

    def update(self, bytes_done: int, bytes_total: int | None) -> None:
        with self._lock:
            now = self._clock()
            if now - self._last < self._interval_s:
                return
            self._last = now
        self._hook.progress(bytes_done, bytes_total)


def path_size(path: Path) -> int:
    """Bytes of a file, or of every file below a folder (symlinked files followed,
    as in a huggingface_hub snapshot whose files point into ``blobs/``)."""
    if not path.is_dir():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # a dangling link counts for nothing rather than failing the fetch
                continue
    return total
