"""Tensors in POSIX shared memory (/dev/shm files): the same-node data plane.

The producer copies a tensor once into a new block and sends a ShmRef; a consumer
on the same node and IPC namespace maps the block copy-on-write and reads it in
place. Blocks are plain files (os.open + mmap), not multiprocessing.shared_memory,
whose resource tracker unlinks and warns about blocks behind their owner's back.

Names are ``omni-{mesh_id}-{pid}-{counter:x}``: the mesh prefix keeps meshes on one
host apart, and the pid lets ``sweep`` find blocks whose producer died. ``sweep``
assumes every process sharing the /dev/shm also shares the PID namespace (one Pod
with shareProcessNamespace, or one machine).
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.mesh import tensors
from services.mesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.mesh.node import check_mesh_id, node_identity, same_ipc
from services.mesh.pb.omni.v1 import tensor_pb2

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
BLOCK_NAME = re.compile(
    r"omni-(?P<mesh>[a-z0-9][a-z0-9-]{0,30})-(?P<pid>[1-9][0-9]{0,9})-(?P<counter>[0-9a-f]{1,16})"
)

# One counter per process, so two producers of one mesh never pick the same name.
_COUNTER = itertools.count(1)
# Blocks this process created and still holds: sweep spares them even though
# their pid (ours) is alive, and removes older blocks that merely reuse our pid.
_HELD: set[str] = set()


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
            _HELD.add(name)
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
            name = f"omni-{self.mesh_id}-{pid}-{next(_COUNTER):x}"
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
                _HELD.discard(name)
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
    """Map a ShmRef's bytes copy-on-write and view them as a tensor (no read copy).

    Every check that needs no file system runs first; the block is then opened
    without following links and bounded by its real size, so a ref can never make
    this process read outside the block.
    """
    ref = msg.shm
    where = f"{field}.shm"
    _check_name(ref.name, mesh_id, f"{where}.name")
    expected = tensors.nbytes_of(msg, field)
    dtype = tensors.DTYPES[msg.dtype]
    if ref.nbytes != expected:
        raise InvalidArgument(
            f"{where}.nbytes: dtype {msg.dtype} and shape {list(msg.shape)} need {expected} "
            f"bytes, the ref says {ref.nbytes}",
            field=f"{where}.nbytes",
        )
    if ref.offset % dtype.itemsize:
        raise InvalidArgument(
            f"{where}.offset: {ref.offset} is not a multiple of {msg.dtype}'s size",
            field=f"{where}.offset",
        )
    if not ref.HasField("producer"):
        raise InvalidArgument(f"{where}.producer: missing", field=f"{where}.producer")
    if not same_ipc(ref.producer, node_identity()):
        raise FailedPrecondition(
            f"{where}: block {ref.name} lives on another node or IPC namespace", field=where
        )
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(root / ref.name, flags)
    except FileNotFoundError:
        raise FailedPrecondition(
            f"{where}.name: block {ref.name} is gone (released, expired or its producer died)",
            field=f"{where}.name",
        ) from None
    except OSError as exc:
        reason = errno.errorcode.get(exc.errno or 0, "error")
        raise FailedPrecondition(
            f"{where}.name: block {ref.name} cannot be opened ({reason})",
            field=f"{where}.name",
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FailedPrecondition(
                f"{where}.name: {ref.name} is not a block", field=f"{where}.name"
            )
        if ref.offset + ref.nbytes > info.st_size:
            raise InvalidArgument(
                f"{where}.offset: bytes {ref.offset}..{ref.offset + ref.nbytes} lie outside "
                f"block {ref.name} of {info.st_size} bytes",
                field=f"{where}.offset",
            )
        if ref.nbytes == 0:
            return torch.empty(tuple(msg.shape), dtype=dtype)
        # /proc/self/fd/N reopens exactly the inode checked above (no race with a
        # rename); torch's storage owns the MAP_PRIVATE mapping and unmaps it when
        # the last view dies, and keeps no descriptor open meanwhile.
        flat = torch.from_file(
            f"/proc/self/fd/{fd}", shared=False, size=ref.offset + ref.nbytes, dtype=torch.uint8
        )
    finally:
        os.close(fd)
    return flat[ref.offset :].view(dtype).reshape(tuple(msg.shape))


def _check_name(name: str, mesh_id: str, field: str) -> None:
    shown = repr(name[:80])
    if not name or "/" in name or "\0" in name or ".." in name or name.startswith("."):
        raise InvalidArgument(f"{field}: {shown} is not a bare block name", field=field)
    match = BLOCK_NAME.fullmatch(name)
    if match is None:
        raise InvalidArgument(
            f"{field}: {shown} is not a block name (omni-<mesh>-<pid>-<n>)", field=field
        )
    if match["mesh"] != mesh_id:
        raise FailedPrecondition(
            f"{field}: {shown} is not a block of this mesh ({mesh_id})", field=field
        )


def sweep(mesh_id: str, root: Path = SHM_ROOT) -> list[str]:
    """Unlink blocks of ``mesh_id`` whose producer is dead; return their names.

    Consumers that still map a removed block keep reading it: unlinking only
    drops the name, the memory goes when the last mapping does.
    """
    check_mesh_id(mesh_id)
    removed: list[str] = []
    with os.scandir(root) as entries:
        for entry in entries:
            match = BLOCK_NAME.fullmatch(entry.name)
            if match is None or match["mesh"] != mesh_id or _alive(int(match["pid"]), entry.name):
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(entry.name)
    if removed:
        logger.info("shm: swept %s block(s) of dead producers in mesh %s", len(removed), mesh_id)
    return removed


def _alive(pid: int, name: str) -> bool:
    if pid == os.getpid():
        # Our pid, not our block: a previous process (e.g. a restarted container)
        # had the same number.
        return name in _HELD
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True
