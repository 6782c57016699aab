"""A mesh's shared-memory directory: where its blocks live, who can see them,
and which of them are still owned, so that the sweep never removes a live block.

    /dev/shm/omni-<uid>-<mesh>/                      0700, owned by the mesh's uid
        <producer>.lock                              flocked by its producer for life
        omni-<mesh>-<producer>-<request>-<secret>    a block handed to a request
        omni-<mesh>-<producer>-free-<secret>         a pooled block between requests

The directory keeps other local users from listing or opening blocks (/dev/shm
itself is world-listable). Every process of a mesh, containers of a chart stage
group included, runs as the mesh's uid and opens blocks inside it; a directory
that is not private to that uid is refused, never used.

Liveness is a lock, not a pid. A producer holds an exclusive ``flock`` on its
lock file from before its first block until it is gone; the kernel drops the
lock when the process dies, however it dies. flock lives on the file in the
shared tmpfs, so it holds across PID namespaces and containers, where a pid
means nothing. The sweep removes a producer's blocks only once it has taken that
lock itself, and blocks whose lock file is gone (a producer's lock file exists
before its first block, so only a sweep that held the lock removed it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.mesh.data.shm_names import BLOCK_NAME, MESH, PRODUCER_HEX, block_name
from services.mesh.environment import check_mesh_id
from services.mesh.errors import FailedPrecondition

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
_DIR = re.compile(rf"omni-(?P<uid>[0-9]+)-(?P<mesh>{MESH})")
_LOCK = re.compile(rf"(?P<producer>[0-9a-f]{{{PRODUCER_HEX}}})\.lock")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def mesh_dir(mesh_id: str, root: Path = SHM_ROOT) -> Path:
    """The directory of ``mesh_id``'s blocks for this process's uid."""
    return root / f"omni-{os.geteuid()}-{check_mesh_id(mesh_id)}"


def open_dir(path: Path) -> int:
    """A descriptor of ``path``, checked to be a directory private to this uid.
    FileNotFoundError when there is none; FailedPrecondition when it is not ours."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno == errno.EACCES:  # another user's, and closed to us
            raise FailedPrecondition(
                f"shared-memory directory {path} is not ours ({exc.strerror}): refused"
            ) from None
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise FailedPrecondition(
            f"shared-memory directory {path} is a link or not a directory: refused"
        ) from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise FailedPrecondition(
                f"shared-memory directory {path} is not private to uid {os.geteuid()} "
                f"(owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}): refused"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


class ProducerDir:
    """A producer's place in its mesh directory: the lock that says it is alive
    and the blocks it creates, renames and unlinks there, all named with the
    lock's token. They are swept only once the lock is free: this process is gone."""

    def __init__(self, mesh_id: str, root: Path = SHM_ROOT) -> None:
        self.mesh_id = mesh_id
        self.path = mesh_dir(mesh_id, root)
        self.token = ""
        self._dir_fd = -1
        self._lock_fd = -1
        # A sweep may remove an empty directory between our mkdir and our lock
        # file landing in it: then the link fails ENOENT and we start again.
        for _ in range(100):
            if self._claim():
                return
        raise FailedPrecondition(f"shared-memory directory {self.path} kept disappearing")

    def _claim(self) -> bool:
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except PermissionError as exc:  # /dev/shm not writable by us (a volume's owner)
            raise FailedPrecondition(
                f"cannot make the shared-memory directory {self.path} ({exc.strerror})"
            ) from None
        try:
            dir_fd = open_dir(self.path)
        except FileNotFoundError:
            return False
        token = secrets.token_hex(PRODUCER_HEX // 2)
        try:
            # Unnamed until locked: nobody can see the lock file free, so no sweep
            # takes it between its creation and our flock.
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.link(f"/proc/self/fd/{fd}", f"{token}.lock", dst_dir_fd=dir_fd)
            except BaseException:
                os.close(fd)
                raise
        except FileNotFoundError:
            removed = os.fstat(dir_fd).st_nlink == 0  # by a sweep, under us: try again
            os.close(dir_fd)
            if removed:
                return False
            raise  # no /proc/self/fd to link from, say
        except BaseException:
            os.close(dir_fd)
            raise
        self.token, self._dir_fd, self._lock_fd = token, dir_fd, fd
        return True

    def create(self, request_id: str) -> tuple[str, int]:
        """A new empty block (mode 0600) named for request ``request_id``, and its
        descriptor."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            name = block_name(self.mesh_id, self.token, request_id)
            try:
                return name, os.open(name, flags, 0o600, dir_fd=self._dir_fd)
            except FileExistsError:
                continue  # 128 random bits met again: draw another

    def rename(self, name: str, request_id: str | None) -> str | None:
        """Block ``name`` under a fresh name for ``request_id`` (None: free), or None
        when it was removed behind our back."""
        fresh = block_name(self.mesh_id, self.token, request_id)
        try:
            os.rename(name, fresh, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None
        return fresh

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass  # removed by hand: it is gone either way

    def close(self) -> None:
        """Give the place up, after unlinking the blocks (any left are swept)."""
        if self._lock_fd < 0:
            return
        self.unlink(f"{self.token}.lock")
        os.close(self._lock_fd)
        os.close(self._dir_fd)
        self._lock_fd = self._dir_fd = -1
        with contextlib.suppress(OSError):  # the last one out; if empty (else it stays)
            os.rmdir(self.path)


def sweep(mesh_id: str, root: Path = SHM_ROOT, *, every_mesh: bool = True) -> list[str]:
    """Unlink blocks whose producer is gone; return their names. Every mesh of
    this uid on this machine is swept (a mesh killed outright sweeps nothing
    itself), unless ``every_mesh`` is False: then only ``mesh_id``'s. A mesh
    directory left empty is removed.

    Consumers that still map a removed block keep reading it: unlinking only
    drops the name, the memory goes when the last mapping does.
    """
    check_mesh_id(mesh_id)
    removed: list[str] = []
    for path in _mesh_dirs(root):
        if every_mesh or path.name == mesh_dir(mesh_id, root).name:
            removed += _sweep_dir(path)
    if removed:
        logger.info("shm: swept %s block(s) of producers that are gone", len(removed))
    return removed


def _mesh_dirs(root: Path) -> Iterator[Path]:
    uid = str(os.geteuid())
    with os.scandir(root) as entries:
        for entry in entries:
            match = _DIR.fullmatch(entry.name)
            if match is not None and match["uid"] == uid:
                yield Path(entry.path)


def _sweep_dir(path: Path) -> list[str]:
    try:
        dir_fd = open_dir(path)
    except (FileNotFoundError, FailedPrecondition):
        return []  # gone meanwhile, or not ours: nothing of ours to sweep there
    removed: list[str] = []
    try:
        names = os.listdir(dir_fd)
        producers = {m["producer"] for m in map(_LOCK.fullmatch, names) if m}
        for producer in producers:
            with _taken(dir_fd, producer) as gone:
                if gone:  # listed again: it may have renamed a block before it died
                    removed += _unlink_blocks(dir_fd, os.listdir(dir_fd), producer)
                    _unlink(dir_fd, f"{producer}.lock")
        # Blocks whose lock file is gone: their producer's sweep stopped half-way.
        orphans = {
            m["producer"]
            for m in map(BLOCK_NAME.fullmatch, names)
            if m and m["producer"] not in producers and not _exists(dir_fd, f"{m['producer']}.lock")
        }
        for producer in orphans:
            removed += _unlink_blocks(dir_fd, names, producer)
    finally:
        os.close(dir_fd)
    try:
        os.rmdir(path)  # only when empty: then no producer of the mesh is alive
    except OSError:
        pass
    return removed


@contextmanager
def _taken(dir_fd: int, producer: str) -> Iterator[bool]:
    """Whether ``producer``'s lock could be taken (it is gone); held meanwhile."""
    try:
        fd = os.open(f"{producer}.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        yield False  # removed by another sweep, or not a plain file: not ours to judge
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False  # held: its producer is alive
            return
        yield True
    finally:
        os.close(fd)


def _unlink_blocks(dir_fd: int, names: list[str], producer: str) -> list[str]:
    removed = []
    for name in names:
        match = BLOCK_NAME.fullmatch(name)
        if match is not None and match["producer"] == producer and _unlink(dir_fd, name):
            removed.append(name)
    return removed


def _unlink(dir_fd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
