"""The device lock against a real second process holding it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.mesh.errors import InitFailed
from services.stage.startup.device_lock import DeviceLock, lock_file_name

REPO_ROOT = Path(__file__).resolve().parents[3]

HOLDER = """
import asyncio, sys, time
from pathlib import Path
from services.stage.startup.device_lock import DeviceLock

lock = DeviceLock(sys.argv[1], "thinker", Path(sys.argv[2]))
asyncio.run(lock.acquire(timeout_s=10))
print("HELD", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process that holds the "cuda:0" lock until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "cuda:0", str(tmp_path)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "HELD", proc.stderr.read() if proc.stderr else line
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_timeout_names_the_holder_then_kill_frees_the_lock(
    holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    lock = DeviceLock("cuda:0", "talker", tmp_path)
    seen: list[str] = []
    started = time.monotonic()
    with pytest.raises(InitFailed) as info:
        await lock.acquire(timeout_s=0.3, on_wait=seen.append, poll_s=0.02)
    assert 0.3 <= time.monotonic() - started < 2.0
    message = str(info.value)
    assert message.startswith("device cuda:0: lock held by stage 'thinker'")
    assert f"(pid {holder.pid}, since " in message
    assert message.endswith("gave up after 0.3s (stage_init_timeout)")
    assert len(seen) == 1 and seen[0].startswith(f"stage 'thinker' (pid {holder.pid}, since 20")
    assert not lock.held

    holder.kill()  # no release: the kernel drops the lock with the process
    holder.wait(timeout=10)
    await lock.acquire(timeout_s=2.0, on_wait=seen.append)
    assert len(seen) == 1  # free at the first try: no second wait
    assert lock.holder().startswith(f"stage 'talker' (pid {os.getpid()}, since ")
    lock.release()
    lock.release()  # safe twice
    assert lock.holder() == "an unknown holder"


async def test_acquirers_in_one_process_serialize(tmp_path: Path) -> None:
    order: list[str] = []
    waits: list[str] = []

    async def stage(name: str) -> float:
        lock = DeviceLock("cpu", name, tmp_path)
        waited = await lock.acquire(timeout_s=5.0, on_wait=waits.append, poll_s=0.01)
        order.append(f"{name} in")
        await asyncio.sleep(0.15)
        order.append(f"{name} out")
        lock.release()
        return waited

    waited = dict(zip("ab", await asyncio.gather(stage("a"), stage("b")), strict=True))
    assert order in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])
    first, second = order[0][0], order[2][0]
    # Only the second waited, for the first, and for about as long as the first held it.
    assert len(waits) == 1 and waits[0].startswith(f"stage '{first}' ")
    assert waited[second] >= 0.1


def test_lock_file_names_are_safe_and_distinct() -> None:
    names = {lock_file_name(d) for d in ("cpu", "cuda:0", "cuda_0", "../etc", "GPU-3f2a-77")}
    assert len(names) == 5
    assert all("/" not in n and not n.startswith(".") for n in names)
    assert lock_file_name("cuda:0").startswith("cuda_0-")


def test_default_lock_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNI_LOCK_DIR", str(tmp_path))
    assert DeviceLock("cpu", "x").path.parent == tmp_path
    monkeypatch.delenv("OMNI_LOCK_DIR")
    assert DeviceLock("cpu", "x").path.parent == Path(f"/tmp/omni-locks-{os.getuid()}")


async def test_a_planted_link_is_refused_and_its_target_stays_intact(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    locks = tmp_path / "locks"
    lock = DeviceLock("cuda:0", "thinker", locks)
    locks.mkdir(mode=0o700)
    lock.path.symlink_to(victim)
    with pytest.raises(InitFailed) as err:
        await lock.acquire(timeout_s=1.0)
    assert "symbolic link" in err.value.message and str(lock.path) in err.value.message
    assert victim.read_text() == "precious" and not lock.held


async def test_the_lock_dir_is_created_private(tmp_path: Path) -> None:
    lock = DeviceLock("cpu", "thinker", tmp_path / "new" / "locks")
    await lock.acquire(timeout_s=1.0)
    try:
        assert (tmp_path / "new" / "locks").stat().st_mode & 0o777 == 0o700
        assert lock.path.stat().st_mode & 0o777 == 0o600
    finally:
        lock.release()
    # A lock dir that is itself a link is refused.
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InitFailed):
        await DeviceLock("cpu", "x", tmp_path / "linked").acquire(timeout_s=1.0)
