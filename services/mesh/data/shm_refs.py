"""Shared blocks by name, without torch: checking a ShmRef and opening its block
(every check that needs no file system first, then the block opened without
following links and bounded by its real size, so a ref can never make a process
read outside its block), and sweeping blocks whose producer died.

Stages map the block as a tensor (``shm.open_tensor``); the orchestrator, which
never imports torch, reads a ref's bytes for a client with ``read_bytes`` and
sweeps with ``sweep``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.mesh.data.node import node_identity, same_ipc
from services.mesh.data.wire import ITEMSIZE, nbytes_of
from services.mesh.environment import check_mesh_id
from services.mesh.errors import FailedPrecondition, InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
# The secret makes a block a capability: its name cannot be guessed from the
# producer's pid and a counter, so only those it was handed to can name it.
SECRET_HEX = 32
BLOCK_NAME = re.compile(
    r"omni-(?P<mesh>[a-z0-9][a-z0-9-]{0,30})-(?P<pid>[1-9][0-9]{0,9})"
    rf"-(?P<counter>[0-9a-f]{{1,16}})-(?P<secret>[0-9a-f]{{{SECRET_HEX}}})"
)
# Blocks this process created and still holds: sweep spares them even though
# their pid (ours) is alive, and removes older blocks that merely reuse our pid.
HELD: set[str] = set()
# One counter per process, so two producers of one mesh never pick the same name.
_COUNTER = itertools.count(1)


def new_name(mesh_id: str) -> str:
    """A fresh block name of this process: mesh prefix, pid, counter, secret."""
    secret = secrets.token_hex(SECRET_HEX // 2)
    return f"omni-{mesh_id}-{os.getpid()}-{next(_COUNTER):x}-{secret}"


def create_block(root: Path, mesh_id: str) -> tuple[str, int]:
    """A new empty block file (mode 0600) under a fresh name, and its descriptor."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        name = new_name(mesh_id)
        try:
            return name, os.open(root / name, flags, 0o600)
        except FileExistsError:
            continue  # left by a dead process that had our pid; sweep removes it


def check_name(name: str, mesh_id: str, field: str) -> None:
    shown = repr(name[:80])
    if not name or "/" in name or "\0" in name or ".." in name or name.startswith("."):
        raise InvalidArgument(f"{field}: {shown} is not a bare block name", field=field)
    match = BLOCK_NAME.fullmatch(name)
    if match is None:
        raise InvalidArgument(
            f"{field}: {shown} is not a block name (omni-<mesh>-<pid>-<n>-<secret>)",
            field=field,
        )
    if match["mesh"] != mesh_id:
        raise FailedPrecondition(
            f"{field}: {shown} is not a block of this mesh ({mesh_id})", field=field
        )


def check_ref(msg: tensor_pb2.Tensor, mesh_id: str, field: str) -> None:
    """What can be checked of an ShmRef without touching the file system."""
    ref = msg.shm
    where = f"{field}.shm"
    check_name(ref.name, mesh_id, f"{where}.name")
    expected = nbytes_of(msg, field)
    if ref.nbytes != expected:
        raise InvalidArgument(
            f"{where}.nbytes: dtype {msg.dtype} and shape {list(msg.shape)} need {expected} "
            f"bytes, the ref says {ref.nbytes}",
            field=f"{where}.nbytes",
        )
    if ref.offset % ITEMSIZE[msg.dtype]:
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


@contextmanager
def opened_block(msg: tensor_pb2.Tensor, mesh_id: str, field: str, root: Path) -> Iterator[int]:
    """A descriptor of the ref's block, checked to hold the ref's bytes; closed after."""
    check_ref(msg, mesh_id, field)
    ref = msg.shm
    where = f"{field}.shm"
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
        yield fd
    finally:
        os.close(fd)


def read_bytes(
    msg: tensor_pb2.Tensor, *, mesh_id: str, field: str, root: Path = SHM_ROOT
) -> tensor_pb2.Tensor:
    """The ref's tensor as inline bytes (one copy out of the block)."""
    with opened_block(msg, mesh_id, field, root) as fd:
        ref = msg.shm
        if ref.nbytes == 0:
            raw = b""
        else:
            with mmap.mmap(fd, ref.offset + ref.nbytes, prot=mmap.PROT_READ) as block:
                raw = block[ref.offset : ref.offset + ref.nbytes]
    return tensor_pb2.Tensor(name=msg.name, dtype=msg.dtype, shape=msg.shape, raw=raw)


def sweep(mesh_id: str, root: Path = SHM_ROOT, *, every_mesh: bool = True) -> list[str]:
    """Unlink blocks whose producer is dead; return their names. Blocks of every
    mesh on this machine are swept (a mesh killed outright sweeps nothing itself),
    unless ``every_mesh`` is False: then only ``mesh_id``'s.

    Consumers that still map a removed block keep reading it: unlinking only
    drops the name, the memory goes when the last mapping does.
    """
    check_mesh_id(mesh_id)
    removed: list[str] = []
    with os.scandir(root) as entries:
        for entry in entries:
            match = BLOCK_NAME.fullmatch(entry.name)
            if match is None or (not every_mesh and match["mesh"] != mesh_id):
                continue
            if _alive(int(match["pid"]), entry.name):
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(entry.name)
    if removed:
        logger.info("shm: swept %s block(s) of dead producers", len(removed))
    return removed


def _alive(pid: int, name: str) -> bool:
    if pid == os.getpid():
        # Our pid, not our block: a previous process (e.g. a restarted container)
        # had the same number.
        return name in HELD
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True
