"""Tensors in POSIX shared memory (/dev/shm files): the same-node data plane.

The producer puts a tensor into a block (one copy) or generates it straight into
one (``allocate``, then ``share``: no copy) and sends a ShmRef; a consumer on the
same node and IPC namespace maps the block copy-on-write and reads it in place.
Blocks of a MiB or more come from a pool of pre-faulted blocks reused across
requests (``shm_pool``); smaller ones are files of their exact size. Blocks are
plain files (os.open + mmap), not multiprocessing.shared_memory, whose resource
tracker unlinks and warns about blocks behind their owner's back.

Blocks live in the mesh's private directory (``shm_dir``), which the producer
claims with a lock held for its life: that lock, not a pid, tells ``sweep`` the
producer is alive, across PID namespaces and containers. A block's name
(``shm_names``) binds it to the request it was made for and carries a random
secret; a pooled block is renamed each time it comes back and each time it is
taken, so an old name opens nothing.

A released block is reused: its consumer promises, by releasing, that it holds no
mapping of it any more (a mapping kept past release would see the next request's
bytes). Blocks that expire by TTL are unlinked, never reused.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.mesh.data.node import node_identity
from services.mesh.data.shm_dir import SHM_ROOT, ProducerDir, sweep
from services.mesh.data.shm_pool import DEFAULT_MAX_BYTES, MIN_CLASS, BlockPool, PoolBlock
from services.mesh.data.shm_refs import opened_block
from services.mesh.environment import check_mesh_id
from services.mesh.errors import ResourceExhausted
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec

__all__ = ["SHM_ROOT", "ShmProducer", "open_tensor", "sweep"]

logger = logging.getLogger(__name__)


@dataclass
class _Block:
    owner: str
    created: float
    pooled: PoolBlock | None = None
    # Live writable views the producer's own code holds (``allocate``): a pooled
    # block is reused only once they are gone, whatever its consumers said.
    views: int = 0
    shipped: bool = True  # its name went out in a ref
    released: bool = False


class ShmProducer:
    """Owns the blocks this process shares; frees them on release, TTL or close.

    Tensors of ``MIN_CLASS`` bytes or more go into pooled blocks (``shm_pool``)
    when ``pool_bytes`` > 0: a released block is renamed and reused by a later
    request. ``allocate`` hands out a pooled block as a writable tensor for code
    that generates straight into it; ``share`` then sends it with no copy."""

    def __init__(
        self,
        mesh_id: str,
        *,
        ttl_s: float = 300.0,
        root: Path = SHM_ROOT,
        clock: Callable[[], float] = time.monotonic,
        pool_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.mesh_id = check_mesh_id(mesh_id)
        self.ttl_s = ttl_s
        self.root = root
        self._clock = clock
        # Reentrant: the last view of an allocated block may die (and return it)
        # on a thread that is inside one of these methods.
        self._lock = threading.RLock()
        self._blocks: dict[str, _Block] = {}
        self._by_address: dict[int, str] = {}
        # FailedPrecondition when the mesh's directory is not private to us.
        self.files = ProducerDir(self.mesh_id, root)
        self.pool = BlockPool(self.files, pool_bytes) if pool_bytes > 0 else None

    @property
    def live_names(self) -> list[str]:
        """Blocks handed out (free pooled blocks are not among them)."""
        with self._lock:
            return list(self._blocks)

    def put(self, tensor: torch.Tensor, owner: str) -> tensor_pb2.Tensor:
        """Copy ``tensor`` into a block owned by request ``owner``; return its ref."""
        wire = codec.dtype_name(tensor.dtype)
        source = tensor.detach().resolve_conj().resolve_neg()
        nbytes = source.numel() * source.element_size()
        if self.pool is not None and nbytes >= MIN_CLASS:
            block = self._take(nbytes, owner)
            name = block.name
            try:
                # No name holds the view, so no export of the mapping is left behind.
                torch.frombuffer(block.mapping, dtype=torch.uint8, count=nbytes).view(
                    source.dtype
                ).view(source.shape).copy_(source)
            except BaseException:
                assert self.pool is not None
                self.pool.give_back(block)
                raise
            self._register(name, _Block(owner, self._clock(), block))
        else:
            name = self._put_file(source, nbytes, owner)
        ref = tensor_pb2.ShmRef(name=name, offset=0, nbytes=nbytes, producer=node_identity())
        return tensor_pb2.Tensor(dtype=wire, shape=list(source.shape), shm=ref)

    def allocate(self, owner: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A writable CPU tensor in a pooled block of request ``owner``, to write an
        output into; ``share`` sends it without a copy. A block never shared goes
        back to the pool when its last view dies. Without a pool (or for an empty
        tensor) this is ``torch.empty``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.pool is None or nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        block = self._take(nbytes, owner)
        array = np.frombuffer(block.mapping, dtype=np.uint8, count=nbytes)
        # The array lives exactly as long as the last tensor view of it (torch's
        # storage holds it): its finalizer is how the pool learns the block is free.
        name = block.name
        self._register(name, _Block(owner, self._clock(), block, views=1, shipped=False))
        weakref.finalize(array, self._view_gone, name).atexit = False
        return torch.from_numpy(array).view(dtype).reshape(tuple(shape))

    def share(self, tensor: torch.Tensor, owner: str) -> tensor_pb2.Tensor | None:
        """The ref of ``tensor`` when it lies in a block ``allocate`` gave ``owner``
        (no copy), else None."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        base = tensor.untyped_storage().data_ptr()
        with self._lock:
            name = self._by_address.get(base)
            block = self._blocks.get(name) if name is not None else None
            if block is None or block.pooled is None or block.owner != owner:
                return None
            offset = tensor.data_ptr() - block.pooled.address
            nbytes = tensor.numel() * tensor.element_size()
            if offset < 0 or offset + nbytes > block.pooled.capacity:
                return None
            block.shipped = True
            block.created = self._clock()  # the TTL runs from the hand-off
        wire = codec.dtype_name(tensor.dtype)
        ref = tensor_pb2.ShmRef(name=name, offset=offset, nbytes=nbytes, producer=node_identity())
        return tensor_pb2.Tensor(dtype=wire, shape=list(tensor.shape), shm=ref)

    def release(self, owner: str | None = None, names: Iterable[str] = ()) -> int:
        """Free every block of ``owner`` and the blocks named; unknown names are ignored."""
        wanted = set(names)
        freed: list[str] = []
        with self._lock:
            for name, block in list(self._blocks.items()):
                if block.released or not (name in wanted or (owner and block.owner == owner)):
                    continue
                if name not in self._blocks:
                    continue  # a finalizer that ran meanwhile (gc) returned it already
                freed.append(name)
                block.released = True
                if block.views == 0:
                    self._recycle(name)
        return len(freed)

    def expire(self) -> int:
        """Unlink shipped blocks older than ttl_s (consumers that never called
        ReleaseTensors). They are not reused: a consumer may still be reading."""
        deadline = self._clock() - self.ttl_s
        with self._lock:
            stale = {
                n: b.owner
                for n, b in self._blocks.items()
                if b.shipped and not b.released and b.created <= deadline
            }
        if stale:
            logger.info(
                "shm: %s block(s) of request(s) %s expired after %ss unreleased",
                len(stale),
                ", ".join(sorted(set(stale.values()))),
                self.ttl_s,
            )
        return self._unlink(list(stale))

    def close(self) -> None:
        with self._lock:
            chosen = list(self._blocks)
        self._unlink(chosen)
        if self.pool is not None:
            self.pool.close()
        self.files.close()

    def __enter__(self) -> ShmProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self, nbytes: int, owner: str) -> PoolBlock:
        assert self.pool is not None
        try:
            return self.pool.take(nbytes, owner)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ResourceExhausted(
                    f"shared memory is full: no room for {nbytes} bytes in {self.root}"
                ) from None
            raise

    def _register(self, name: str, block: _Block) -> None:
        with self._lock:
            self._blocks[name] = block
            if block.pooled is not None:
                self._by_address[block.pooled.address] = name

    def _view_gone(self, name: str) -> None:
        with self._lock:
            block = self._blocks.get(name)
            if block is None:
                return  # expired or closed meanwhile: already unlinked
            block.views -= 1
            if block.views == 0 and (block.released or not block.shipped):
                self._recycle(name)

    def _recycle(self, name: str) -> None:
        """Back to the pool (renamed) or unlinked; the caller holds the lock."""
        block = self._blocks.pop(name, None)
        if block is None:
            return
        pooled = block.pooled
        if pooled is None:
            self.files.unlink(name)
            return
        self._by_address.pop(pooled.address, None)
        assert self.pool is not None
        self.pool.give_back(pooled)

    def _put_file(self, source: torch.Tensor, nbytes: int, owner: str) -> str:
        """A block of exactly ``nbytes``, not pooled (small tensors, or no pool)."""
        name, fd = self.files.create(owner)
        # Registered before it is filled, so close() from another thread frees it too.
        with self._lock:
            self._blocks[name] = _Block(owner, self._clock())
        try:
            _fill(fd, source, nbytes)
        except BaseException as exc:
            self._unlink([name])
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise ResourceExhausted(
                    f"shared memory is full: no room for {nbytes} bytes in {self.root}"
                ) from None
            raise
        finally:
            os.close(fd)
        return name

    def _unlink(self, names: list[str]) -> int:
        freed = 0
        for name in names:
            with self._lock:
                block = self._blocks.pop(name, None)
                if block is None:
                    continue  # another thread freed it first
                if block.pooled is not None:
                    self._by_address.pop(block.pooled.address, None)
            self.files.unlink(name)
            freed += 1
        return freed


def _fill(fd: int, tensor: torch.Tensor, nbytes: int) -> None:
    if nbytes == 0:
        return
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        # write(2) allocates the pages as it copies (no zero-fill pass) and reports
        # a full /dev/shm as ENOSPC, where a store through a mapping would SIGBUS.
        view = tensor.reshape(-1).view(torch.uint8).numpy().data
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, view[done:], done)
        return
    # Strided or device tensors: reserve the pages (ENOSPC now, not SIGBUS later),
    # then let torch gather straight into the mapping, still a single copy.
    os.posix_fallocate(fd, 0, nbytes)
    block = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        # No name holds the view, so the mapping has no export left when closed.
        torch.frombuffer(block, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape).copy_(
            tensor
        )
    finally:
        block.close()


def open_tensor(
    msg: tensor_pb2.Tensor, *, mesh_id: str, request_id: str, field: str, root: Path = SHM_ROOT
) -> torch.Tensor:
    """Map a ShmRef's bytes copy-on-write and view them as a tensor (no read copy);
    the ref is checked first (``shm_refs.opened_block``): it must name a block of
    request ``request_id``."""
    ref = msg.shm
    dtype = codec.DTYPES[msg.dtype] if msg.dtype in codec.DTYPES else None
    with opened_block(msg, mesh_id=mesh_id, request_id=request_id, field=field, root=root) as fd:
        assert dtype is not None  # checked by opened_block
        if ref.nbytes == 0:
            return torch.empty(tuple(msg.shape), dtype=dtype)
        # /proc/self/fd/N reopens exactly the inode checked above (no race with a
        # rename); torch's storage owns the MAP_PRIVATE mapping and unmaps it when
        # the last view dies, and keeps no descriptor open meanwhile.
        flat = torch.from_file(
            f"/proc/self/fd/{fd}", shared=False, size=ref.offset + ref.nbytes, dtype=torch.uint8
        )
    return flat[ref.offset :].view(dtype).reshape(tuple(msg.shape))
