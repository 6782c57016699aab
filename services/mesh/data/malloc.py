"""Large buffers reused warm: glibc's malloc set up for a process that moves tensors.

By default glibc gives every allocation over 128 KiB (a threshold that rises to
at most 32 MiB) its own mmap, unmaps it when freed, and trims freed heap memory
back to the system. A tensor stream allocates and frees such buffers all the
time (each chunk's bytes, each serialized message, each decode buffer), so each
is fresh memory, and faulting in a fresh page costs more than copying into it:
several times the copy into memory malloc kept (benchmarks/transport.py; figures
in docs/benchmarks.md). ``keep_freed_memory`` serves allocations
up to ``mmap_threshold`` from malloc's heap and keeps up to ``trim_threshold``
freed bytes mapped for reuse: the price is that a process keeps that much more
memory resident after a peak. Not glibc: nothing changes.

``FreedMemory`` bounds that price: once a burst of large inputs has been given
back (a client's 60 MB messages, say), it asks malloc to return every free page
to the system (``malloc_trim``), so the peak does not stay resident.

``malloc_trim`` cannot reach everything: each thread that allocates gets an arena
of its own (up to eight per core), and the free top of a thread's arena is
returned only by that thread's own frees, past the trim threshold. A stage's
tensors are decoded and copied in worker threads and gRPC's threads read its
frames, so after a burst each of them kept tens of MB that no trim returned, more
with every wave of large inputs (docs/benchmarks.md). ``arenas``
caps how many there are: with one (``ARENAS``), every free page is the trim's to
return, and malloc's per-thread caches still serve small allocations without its
lock (benchmarks/transport.py's mesh bytes moved 64 MiB no slower).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20
ARENAS = 1


def keep_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD,
    trim_threshold: int = TRIM_THRESHOLD,
    arenas: int | None = ARENAS,
) -> bool:
    """True when malloc took every setting. ``arenas``: at most this many malloc
    arenas (None: glibc's default); call it before any thread starts."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
    if arenas is not None:
        done = bool(mallopt(_M_ARENA_MAX, arenas)) and done
    if not done:
        logger.info("malloc: thresholds not taken; large buffers stay fresh mmaps")
    return done


def trim() -> bool:
    """Return free heap memory of every arena to the system; True if any was."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    return bool(malloc_trim(0))


class FreedMemory:
    """Trims the heap once a burst of large buffers is over: when ``after_bytes``
    were freed (``released``, from any thread), ``quiet_s`` after the last of them,
    or ``most_s`` after the first under a steady stream; off the event loop.

    ``after_bytes`` is well under one large message: a burst longer than ``most_s``
    is trimmed in its middle, and what its tail frees must still be enough to trim
    again (at 64 MiB, the last 60 MB message of a wave was not, and the process
    kept what it freed: the message's bytes are what it charges, its copies freed
    more; docs/benchmarks.md)."""

    def __init__(
        self, after_bytes: int = 16 << 20, quiet_s: float = 2.0, most_s: float = 10.0
    ) -> None:
        self._after = after_bytes
        self._quiet_s = quiet_s
        self._most_s = most_s
        self._freed = 0
        self._first = self._last = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.trims = 0

    @property
    def pending_bytes(self) -> int:
        """Freed since the last trim: what the next trim is for."""
        with self._lock:
            return self._freed

    def released(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            if not self._freed:
                self._first = now
            self._freed += nbytes
            self._last = now
            if self._freed >= self._after and self._timer is None:
                self._start(self._quiet_s)

    def _start(self, delay_s: float) -> None:
        self._timer = threading.Timer(delay_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            now = time.monotonic()
            wait = min(self._last + self._quiet_s, self._first + self._most_s) - now
            if wait > 0:  # still freeing: the burst is not over
                self._start(wait)
                return
            freed, self._freed, self._timer = self._freed, 0, None
        trim()
        self.trims += 1
        logger.debug("malloc: trimmed the heap after %d freed bytes", freed)

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
