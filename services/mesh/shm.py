"""Tensors in POSIX shared memory (/dev/shm files): the same-node data plane.

The producer copies a tensor once into a new block and sends a ShmRef; a consumer
on the same node and IPC namespace maps the block copy-on-write and reads it in
place. Blocks are plain files (os.open + mmap), not multiprocessing.shared_memory,
whose resource tracker unlinks and warns about blocks behind their owner's back.

Names are ``omni-{mesh_id}-{pid}-{counter:x}-{secret}``: the mesh prefix keeps meshes
on one host apart, the pid lets ``sweep`` find blocks whose producer died, and
the random secret makes the name a capability (a consumer must be handed it). ``sweep``
assumes every process sharing the /dev/shm also shares the PID namespace (one Pod
with shareProcessNamespace, or one machine).
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.mesh import tensors
from services.mesh.errors import ResourceExhausted
from services.mesh.node import check_mesh_id, node_identity
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.shm_refs import HELD, SECRET_HEX, SHM_ROOT, opened_block, sweep

__all__ = ["SHM_ROOT", "ShmProducer", "open_tensor", "sweep"]

logger = logging.getLogger(__name__)

# One counter per process, so two producers of one mesh never pick the same name.
_COUNTER = itertools.count(1)


@dataclass(frozen=True)
class _Block:
    owner: str
    created: float


class ShmProducer:
    """Owns the blocks this process shares; frees them on release, TTL or close."""

    def __init__(
        self,
        mesh_id: str,
        *,
        ttl_s: float = 300.0,
        root: Path = SHM_ROOT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mesh_id = check_mesh_id(mesh_id)
        self.ttl_s = ttl_s
        self.root = root
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: dict[str, _Block] = {}

    @property
    def live_names(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def put(self, tensor: torch.Tensor, owner: str) -> tensor_pb2.Tensor:
        """Copy ``tensor`` into a new block owned by request ``owner``; return its ref."""
        wire = tensors.dtype_name(tensor.dtype)
        source = tensor.detach().resolve_conj().resolve_neg()
        nbytes = source.numel() * source.element_size()
        name, fd = self._create()
        # Registered before it is filled, so close() from another thread frees it too.
        with self._lock:
            self._blocks[name] = _Block(owner, self._clock())
            HELD.add(name)
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
        ref = tensor_pb2.ShmRef(name=name, offset=0, nbytes=nbytes, producer=node_identity())
        return tensor_pb2.Tensor(dtype=wire, shape=list(source.shape), shm=ref)

    def release(self, owner: str | None = None, names: Iterable[str] = ()) -> int:
        """Free every block of ``owner`` and the blocks named; unknown names are ignored."""
        wanted = set(names)
        with self._lock:
            chosen = [
                n for n, b in self._blocks.items() if n in wanted or (owner and b.owner == owner)
            ]
        return self._unlink(chosen)

    def expire(self) -> int:
        """Free blocks older than ttl_s (consumers that never called ReleaseTensors)."""
        deadline = self._clock() - self.ttl_s
        with self._lock:
            stale = {n: b.owner for n, b in self._blocks.items() if b.created <= deadline}
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

    def __enter__(self) -> ShmProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> tuple[str, int]:
        pid = os.getpid()
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            secret = secrets.token_hex(SECRET_HEX // 2)
            name = f"omni-{self.mesh_id}-{pid}-{next(_COUNTER):x}-{secret}"
            try:
                return name, os.open(self.root / name, flags, 0o600)
            except FileExistsError:
                continue  # left by a dead process that had our pid; sweep removes it

    def _unlink(self, names: list[str]) -> int:
        freed = 0
        for name in names:
            with self._lock:
                if self._blocks.pop(name, None) is None:
                    continue  # another thread freed it first
                HELD.discard(name)
            try:
                os.unlink(self.root / name)
            except FileNotFoundError:
                pass  # swept by someone else: it is gone either way
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
    msg: tensor_pb2.Tensor, *, mesh_id: str, field: str, root: Path = SHM_ROOT
) -> torch.Tensor:
    """Map a ShmRef's bytes copy-on-write and view them as a tensor (no read copy);
    the ref is checked first (``shm_refs.opened_block``)."""
    ref = msg.shm
    dtype = tensors.DTYPES[msg.dtype] if msg.dtype in tensors.DTYPES else None
    with opened_block(msg, mesh_id, field, root) as fd:
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
