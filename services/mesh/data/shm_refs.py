"""Shared blocks by name, without torch: checking a ShmRef and opening its block
(every check that needs no file system first, then the block opened inside the
mesh's private directory without following links and bounded by its real size,
so a ref can never make a process read outside its block).

A ref is honoured only for the request it was made for: its name carries a
digest of that request's id (``shm_names``). Stages map the block as a tensor
(``shm.open_tensor``); the orchestrator, which never imports torch, reads a
ref's bytes for a client with ``read_bytes``.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.mesh.data.node import node_identity, same_ipc
from services.mesh.data.shm_dir import SHM_ROOT, mesh_dir, open_dir
from services.mesh.data.shm_names import BLOCK_NAME, request_tag
from services.mesh.data.wire import ITEMSIZE, nbytes_of
from services.mesh.errors import FailedPrecondition, InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2

__all__ = ["SHM_ROOT", "check_ref", "opened_block", "read_bytes"]


def check_name(name: str, mesh_id: str, request_id: str, field: str) -> None:
    shown = repr(name[:80])
    if not name or "/" in name or "\0" in name or ".." in name or name.startswith("."):
        raise InvalidArgument(f"{field}: {shown} is not a bare block name", field=field)
    match = BLOCK_NAME.fullmatch(name)
    if match is None:
        raise InvalidArgument(
            f"{field}: {shown} is not a block name (omni-<mesh>-<producer>-<request>-<secret>)",
            field=field,
        )
    if match["mesh"] != mesh_id:
        raise FailedPrecondition(
            f"{field}: {shown} is not a block of this mesh ({mesh_id})", field=field
        )
    if match["request"] != request_tag(request_id):
        raise FailedPrecondition(
            f"{field}: block {shown} was not made for request {request_id!r}: a ref is "
            "honoured only in the request it was handed to",
            field=field,
        )


def check_ref(msg: tensor_pb2.Tensor, mesh_id: str, request_id: str, field: str) -> None:
    """What can be checked of an ShmRef in request ``request_id`` without touching
    the file system."""
    ref = msg.shm
    where = f"{field}.shm"
    check_name(ref.name, mesh_id, request_id, f"{where}.name")
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
def opened_block(
    msg: tensor_pb2.Tensor, *, mesh_id: str, request_id: str, field: str, root: Path
) -> Iterator[int]:
    """A descriptor of the ref's block, checked to hold the ref's bytes; closed after."""
    check_ref(msg, mesh_id, request_id, field)
    ref = msg.shm
    where = f"{field}.shm"
    gone = FailedPrecondition(
        f"{where}.name: block {ref.name} is gone (released, expired or its producer died)",
        field=f"{where}.name",
    )
    try:
        dir_fd = open_dir(mesh_dir(mesh_id, root))
    except FileNotFoundError:
        raise gone from None
    except FailedPrecondition as exc:
        raise FailedPrecondition(f"{where}.name: {exc.message}", field=f"{where}.name") from None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(ref.name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise gone from None
    except OSError as exc:
        reason = errno.errorcode.get(exc.errno or 0, "error")
        raise FailedPrecondition(
            f"{where}.name: block {ref.name} cannot be opened ({reason})",
            field=f"{where}.name",
        ) from None
    finally:
        os.close(dir_fd)
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
    msg: tensor_pb2.Tensor, *, mesh_id: str, request_id: str, field: str, root: Path = SHM_ROOT
) -> tensor_pb2.Tensor:
    """The ref's tensor as inline bytes (one copy out of the block)."""
    with opened_block(msg, mesh_id=mesh_id, request_id=request_id, field=field, root=root) as fd:
        ref = msg.shm
        if ref.nbytes == 0:
            raw = b""
        else:
            with mmap.mmap(fd, ref.offset + ref.nbytes, prot=mmap.PROT_READ) as block:
                raw = block[ref.offset : ref.offset + ref.nbytes]
    return tensor_pb2.Tensor(name=msg.name, dtype=msg.dtype, shape=msg.shape, raw=raw)
