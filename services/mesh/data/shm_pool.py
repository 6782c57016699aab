"""Pre-faulted shared blocks reused across requests: a producer's block pool.

A pooled block is a /dev/shm file of a size class (a power of two from
``MIN_CLASS``) that this process keeps mapped for its whole life, every page
allocated and mapped when the block is made (fallocate + MAP_POPULATE). Filling
it again is a warm memcpy: no page faults, no zero-fill, no file creation.
Blocks that come back wait in a free list per class, up to ``max_bytes`` in
all; a block beyond that bound is unlinked instead.

A block name is a capability (``shm_refs``). A block that comes back is renamed
to a fresh unguessable name (``rename(2)`` on tmpfs: atomic, no copy) before it
can be handed out again, so whoever knew its old name, its last consumer or
anyone who read the name, can no longer open or release it. Names keep the
``omni-{mesh}-{pid}-`` form and the pool's names stay in ``HELD``: a free block
is spared by this process's sweeps and swept like any other once it is dead.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.mesh.data.shm_refs import HELD, create_block, new_name

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

    def __init__(self, mesh_id: str, root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.mesh_id = mesh_id
        self.root = root
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

    def take(self, nbytes: int) -> PoolBlock:
        """A free block of ``nbytes``' class, else a new one. OSError (ENOSPC) when
        /dev/shm has no room: raised here, never a SIGBUS at a later store."""
        capacity = size_class(nbytes)
        with self._lock:
            free = self._free.get(capacity)
            if free:
                self._free_bytes -= capacity
                return free.pop()  # the most recently used: warmest in cache
        return self._create(capacity)

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
        fresh = new_name(self.mesh_id)
        HELD.add(fresh)
        try:
            os.rename(self.root / block.name, self.root / fresh)
        except OSError:
            # Swept or removed behind our back: the memory is not ours to reuse.
            HELD.discard(fresh)
            HELD.discard(block.name)
            with self._lock:
                self._free_bytes -= block.capacity
            return False
        HELD.discard(block.name)
        block.name = fresh
        with self._lock:
            self._free.setdefault(block.capacity, []).append(block)
        return True

    def discard(self, block: PoolBlock) -> None:
        """Unlink ``block``; the memory goes once the last mapping of it does."""
        self._unlink(block.name)

    def _unlink(self, name: str) -> None:
        HELD.discard(name)
        try:
            os.unlink(self.root / name)
        except FileNotFoundError:
            pass  # swept by someone else: it is gone either way

    def close(self) -> None:
        with self._lock:
            blocks = [b for free in self._free.values() for b in free]
            self._free.clear()
            self._free_bytes = 0
        for block in blocks:
            self.discard(block)

    def _create(self, capacity: int) -> PoolBlock:
        name, fd = create_block(self.root, self.mesh_id)
        HELD.add(name)
        try:
            # fallocate reports a full /dev/shm as ENOSPC now; MAP_POPULATE then
            # maps every page, so neither the producer's fill nor a later reuse
            # takes a page fault.
            os.posix_fallocate(fd, 0, capacity)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, capacity, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._unlink(name)
            raise
        finally:
            os.close(fd)
        address = int(np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data)
        logger.debug("shm pool: new %s-byte block %s", capacity, name)
        return PoolBlock(name, capacity, mapping, address)
