"""Large buffers reused warm: glibc's malloc set up for a process that moves tensors.

By default glibc gives every allocation over 128 KiB (a threshold that rises to
at most 32 MiB) its own mmap, unmaps it when freed, and trims freed heap memory
back to the system. A tensor stream allocates and frees such buffers all the
time (each chunk's bytes, each serialized message, each decode buffer), so each
is fresh memory, and faulting in a fresh page costs more than copying into it:
64 MiB copied into fresh memory took ~120 ms here against ~20 ms into memory
malloc kept (benchmarks/transport.py). ``keep_freed_memory`` serves allocations
up to ``mmap_threshold`` from malloc's heap and keeps up to ``trim_threshold``
freed bytes mapped for reuse: the price is that a process keeps that much more
memory resident after a peak. Not glibc: nothing changes.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20


def keep_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """True when malloc took both settings."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
    if not done:
        logger.info("malloc: thresholds not taken; large buffers stay fresh mmaps")
    return done
