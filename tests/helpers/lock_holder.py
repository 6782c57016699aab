"""A real second process that holds a device lock, as a neighbouring stage would."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

_HOLD = """\
import asyncio, pathlib, sys, time
from services.stage.startup.device_lock import DeviceLock
lock = DeviceLock("cpu", owner=sys.argv[1], lock_dir=pathlib.Path(sys.argv[2]))
asyncio.run(lock.acquire(5))
print("held", flush=True)
time.sleep(120)
"""


@asynccontextmanager
async def lock_held(lock_dir: Path, owner: str = "neighbour") -> AsyncIterator[int]:
    """The cpu lock in ``lock_dir`` held by another process (its pid) until exit,
    when that process is killed (the kernel then releases the lock)."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD, owner, str(lock_dir), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        assert (await asyncio.wait_for(holder.stdout.readline(), 60)).strip() == b"held"
        yield holder.pid
    finally:
        holder.kill()
        await holder.wait()
