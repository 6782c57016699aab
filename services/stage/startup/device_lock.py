"""A per-device file lock: stages sharing a device initialise one at a time.

Memory planning measures free device memory, which is only meaningful while no
other stage on that device is loading. ``flock`` locks belong to the open file
and the kernel drops them when the holder dies, so a crashed stage never leaves
a stale lock behind. The file also records who holds it, for operators.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from services.mesh import environment
from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)


def lock_file_name(device: str) -> str:
    """A file name for ``device`` ("cpu", "cuda:0", a GPU UUID): readable, and with a
    hash of the exact name so that two devices never share a file after cleaning."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", device)[:64]
    return f"{cleaned}-{hashlib.sha256(device.encode()).hexdigest()[:8]}.lock"


class DeviceLock:
    """Exclusive, process-crash-safe lock on one device. Not reentrant."""

    def __init__(self, device: str, owner: str, lock_dir: Path | None = None) -> None:
        self.device = device
        self.owner = owner
        directory = lock_dir or environment.LOCK_DIR.get()
        self.path = directory / lock_file_name(device)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    async def acquire(
        self,
        timeout_s: float,
        on_wait: Callable[[str], None] | None = None,
        poll_s: float = 0.05,
    ) -> float:
        """Take the lock, polling; returns the seconds waited.

        ``on_wait`` is called once, with the holder's description, when the lock
        is found taken. Raises ``InitFailed`` naming the holder after ``timeout_s``.
        """
        if self._fd is not None:
            raise RuntimeError(f"device lock {self.device} is already held by this object")
        _private_dir(self.path.parent)
        started = time.monotonic()
        try:
            # Never through a link: a planted one would have us truncate its target.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise InitFailed(
                f"device {self.device}: cannot open lock file {self.path} "
                f"({exc.strerror}; a symbolic link there is refused)"
            ) from None
        try:
            waited_once = False
            while not _try_lock(fd):
                if not waited_once:
                    waited_once = True
                    holder = self.holder()
                    logger.info("device %s: waiting for the lock held by %s", self.device, holder)
                    if on_wait is not None:
                        on_wait(holder)
                if time.monotonic() - started >= timeout_s:
                    raise InitFailed(
                        f"device {self.device}: lock held by {self.holder()} — gave up after "
                        f"{timeout_s:.1f}s (stage_init_timeout)"
                    )
                await asyncio.sleep(poll_s)
            _write_holder(fd, self.owner)
        except BaseException:  # timeout and cancellation alike must not leak the descriptor
            os.close(fd)
            raise
        self._fd = fd
        waited = time.monotonic() - started
        logger.info("device %s: lock taken by %r after %.2fs", self.device, self.owner, waited)
        return waited

    def release(self) -> None:
        """Give the lock back; a no-op when not held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # nobody holds it: leave no stale description behind
        finally:
            os.close(fd)  # closing drops the flock
        logger.info("device %s: lock released by %r", self.device, self.owner)

    def holder(self) -> str:
        """Who holds the lock, as recorded in the lock file: owner, pid and since when."""
        try:
            info = json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):
            info = None
        if not isinstance(info, dict):
            return "an unknown holder"
        return f"stage {info.get('owner')!r} (pid {info.get('pid')}, since {info.get('since')})"


def _private_dir(directory: Path) -> None:
    """Create the lock dir 0700; refuse one that is a link or another user's."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise InitFailed(f"device lock dir {directory} is not a directory (a link?)")
    if info.st_uid != os.getuid():
        raise InitFailed(f"device lock dir {directory} belongs to another user (uid {info.st_uid})")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _write_holder(fd: int, owner: str) -> None:
    since = datetime.now(UTC).isoformat(timespec="seconds")
    record = json.dumps({"owner": owner, "pid": os.getpid(), "since": since})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
