"""Pre-faulted shared blocks reused across requests: a producer's block pool.

A pooled block is a /dev/shm file of a size class (a power of two from
``MIN_CLASS``) that this process keeps mapped for its whole life, every page
allocated and mapped when the block is made (fallocate + MAP_POPULATE). Filling
it again is a warm memcpy: no page faults, no zero-fill, no file creation.
Blocks that come back wait in a free list per class, up to ``max_bytes`` in
all; a block beyond that bound is unlinked instead.

A block name is a capability bound to one request (``shm_names``). A block that
comes back is renamed to a fresh free name (``rename(2)`` on tmpfs: atomic, no
copy), and again to a name of its next request when it is taken, so whoever
knew an old name, its last consumer or anyone who read the name, can no longer
open or release it. Every name carries the producer's lock token
(``shm_dir.ProducerDir``): free blocks are swept like any other once the
producer is gone.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from services.mesh.data.shm_dir import ProducerDir

logger = logging.getLogger(__name__)

MIN_CLASS = 1 << 20
DEFAULT_MAX_BYTES = 256 << 20


def size_class(nbytes: int) -> int:
    """The block size that holds ``nbytes``: a power of two, at least MIN_CLASS."""
    return max(MIN_CLASS, 1 << max(nbytes - 1, 0).bit_length())


@dataclass(eq=False)
class PoolBlock:
    """One mapped block; ``name`` changes each time it comes back to the pool."""

    name: str
    capacity: int
    mapping: mmap.mmap
    address: int  # where ``mapping`` starts in this process


class BlockPool:
    """Free pre-faulted blocks by size class, at most ``max_bytes`` of them."""

    def __init__(self, files: ProducerDir, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._files = files
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[PoolBlock]] = {}
        self._free_bytes = 0

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    @property
    def free_names(self) -> list[str]:
        with self._lock:
            return [b.name for blocks in self._free.values() for b in blocks]

    def take(self, nbytes: int, request_id: str) -> PoolBlock:
        """A free block of ``nbytes``' class, else a new one, named for request
        ``request_id``. OSError (ENOSPC) when /dev/shm has no room: raised here,
        never a SIGBUS at a later store."""
        capacity = size_class(nbytes)
        while True:
            with self._lock:
                free = self._free.get(capacity)
                if not free:
                    break
                self._free_bytes -= capacity
                block = free.pop()  # the most recently used: warmest in cache
            if self._rename(block, request_id):
                return block
        return self._create(capacity, request_id)

    def give_back(self, block: PoolBlock) -> bool:
        """Keep ``block`` for reuse under a fresh name, or unlink it when the pool
        is full. True when it was kept."""
        with self._lock:
            keep = self._free_bytes + block.capacity <= self.max_bytes
            if keep:
                self._free_bytes += block.capacity  # reserved before the rename
        if not keep:
            self.discard(block)
            return False
        if not self._rename(block, None):
            with self._lock:
                self._free_bytes -= block.capacity
            return False
        with self._lock:
            self._free.setdefault(block.capacity, []).append(block)
        return True

    def _rename(self, block: PoolBlock, request_id: str | None) -> bool:
        """Give ``block`` a fresh name for ``request_id`` (None: free); False when
        its file was removed behind our back (the memory is not ours to reuse)."""
        fresh = self._files.rename(block.name, request_id)
        if fresh is None:
            return False
        block.name = fresh
        return True

    def discard(self, block: PoolBlock) -> None:
        """Unlink ``block``; the memory goes once the last mapping of it does."""
        self._files.unlink(block.name)

    def close(self) -> None:
        with self._lock:
            blocks = [b for free in self._free.values() for b in free]
            self._free.clear()
            self._free_bytes = 0
        for block in blocks:
            self.discard(block)

    def _create(self, capacity: int, request_id: str) -> PoolBlock:
        name, fd = self._files.create(request_id)
        try:
            # fallocate reports a full /dev/shm as ENOSPC now; MAP_POPULATE then
            # maps every page, so neither the producer's fill nor a later reuse
            # takes a page fault.
            os.posix_fallocate(fd, 0, capacity)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, capacity, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._files.unlink(name)
            raise
        finally:
            os.close(fd)
        address = int(np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data)
        logger.debug("shm pool: new %s-byte block %s", capacity, name)
        return PoolBlock(name, capacity, mapping, address)
