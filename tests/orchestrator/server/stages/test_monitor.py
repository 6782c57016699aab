"""StageMonitor end to end: real stage processes, a real throttled HTTP server, a
device lock held by another process, a stage killed and started again on its port."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from orchestrator.cli.processes import StageProcess
from orchestrator.server.stages.monitor import StageMonitor, StageTarget
from orchestrator.server.stages.watchdog import InitTimeout, WatchdogSettings
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.testing.configs import stage_config, tiny_config, write_config
from tests.helpers.http_server import FileServer
from tests.helpers.lock_holder import lock_held
from tests.helpers.models import tar_folder, tiny_llama_folder

STARTING = orchestrator_pb2.STAGE_STARTING
READY = orchestrator_pb2.STAGE_READY
FAILED = orchestrator_pb2.STAGE_FAILED
DOWN = orchestrator_pb2.STAGE_DOWN
Status = orchestrator_pb2.StageStatus


@pytest.fixture(scope="module")
def archive(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> tuple[Path, int]:
    """A tiny Llama folder as a .tar.gz in a folder of its own (for FileServer), and its size."""
    work = tmp_path_factory.mktemp("model")
    folder = tiny_llama_folder(work / "tiny-llama", smollm2_gguf, omni_cache_dir)
    (work / "site").mkdir()
    path = tar_folder(folder, work / "site" / "tiny-llama.tar.gz")
    return path, path.stat().st_size


@asynccontextmanager
async def monitoring(name: str, address: str, **kwargs: object) -> AsyncIterator[StageMonitor]:
    settings = kwargs.pop("settings")
    assert isinstance(settings, WatchdogSettings)
    monitor = StageMonitor(StageTarget(name, address, settings), **kwargs)  # type: ignore[arg-type]
    await monitor.start()
    try:
        yield monitor
    finally:
        await monitor.stop()


async def until(
    monitor: StageMonitor, done: Callable[[Status], bool], timeout_s: float
) -> list[tuple[float, Status]]:
    """Every status from changes() (with its loop time) up to the first one ``done``."""
    loop = asyncio.get_running_loop()
    seen: list[tuple[float, Status]] = []

    async def follow() -> None:
        async for status in monitor.changes():
            seen.append((loop.time(), status))
            if done(status):
                return

    try:
        await asyncio.wait_for(follow(), timeout_s)
    except TimeoutError:
        last = seen[-1][1] if seen else None
        pytest.fail(f"no such status within {timeout_s}s; last: {last}")
    return seen


def states(seen: list[tuple[float, Status]]) -> list[int]:
    """The distinct states in order (runs of one state folded)."""
    out: list[int] = []
    for _, status in seen:
        if not out or out[-1] != status.state:
            out.append(status.state)
    return out


BUDGET_S = 6.0


async def test_a_download_longer_than_the_budget_still_comes_up(
    tmp_path: Path, archive: tuple[Path, int]
) -> None:
    archive_path, size = archive
    with FileServer(archive_path.parent, rate_bps=size // 9) as server:  # about 10 s
        config = stage_config("slow", tmp_path / "cache", model=server.url(archive_path.name))
        stage = StageProcess(write_config(tmp_path / "slow.yaml", config))
        address = await stage.start()
        try:
            # Loading counts (0.5 s idle, over 2 s seen on a loaded CI machine: hence
            # a 6 s budget); the ~10 s download does not.
            settings = WatchdogSettings(init_timeout_s=BUDGET_S, stall_timeout_s=2.0)
            async with monitoring("slow", address, settings=settings) as monitor:
                calls: list[Status] = []
                monitor.on_change(calls.append)
                seen = await until(monitor, lambda s: s.state != STARTING, timeout_s=90)
                final = monitor.status
        finally:
            await stage.stop()
    assert final.state == READY and monitor.ready, final.message
    assert final.paused_s > 1.25 * BUDGET_S and final.counted_s < BUDGET_S and not final.paused
    assert final.budget_left_s == pytest.approx(BUDGET_S - final.counted_s)
    downloading = [s for _, s in seen if s.paused]
    assert downloading and all(s.state == STARTING for s in downloading)
    assert max(s.bytes_done for s in downloading) > 0
    assert all(s.bytes_total == size for s in downloading if s.bytes_total)
    assert calls and calls[-1].state == READY


async def test_a_stage_timed_out_by_the_watchdog_is_taken_back_when_it_gets_ready(
    tmp_path: Path, archive: tuple[Path, int]
) -> None:
    archive_path, size = archive
    with FileServer(archive_path.parent, rate_bps=size // 3) as server:  # about 4 s
        config = stage_config("late", tmp_path / "cache", model=server.url(archive_path.name))
        stage = StageProcess(write_config(tmp_path / "late.yaml", config))
        address = await stage.start()
        try:
            # The download counts here, so the 1.5 s budget runs out while it goes on.
            settings = WatchdogSettings(1.5, stall_timeout_s=30.0, paused_phases=frozenset())
            async with monitoring("late", address, settings=settings) as monitor:
                calls: list[Status] = []
                monitor.on_change(calls.append)
                seen = await until(monitor, lambda s: s.state == READY, timeout_s=90)
        finally:
            await stage.stop()
    assert states(seen)[-2:] == [FAILED, READY]
    failed = next(s for _, s in seen if s.state == FAILED)
    assert "init timed out" in failed.message
    assert "taken back" in seen[-1][1].message and monitor.ready
    assert calls[-1].state == READY  # what drives the orchestrator's health


async def test_a_stalled_download_fails_saying_so(
    tmp_path: Path, archive: tuple[Path, int]
) -> None:
    archive_path, size = archive
    server = FileServer(archive_path.parent, rate_bps=size, hang_after=size // 2).start()
    try:
        runtime = {"download_stall_timeout_s": 60}  # the watchdog must be the one to notice
        url = server.url(archive_path.name)
        config = stage_config("stuck", tmp_path / "cache", model=url, runtime=runtime)
        stage = StageProcess(write_config(tmp_path / "stuck.yaml", config))
        address = await stage.start()
        try:
            settings = WatchdogSettings(init_timeout_s=30, stall_timeout_s=1.0)
            async with monitoring("stuck", address, settings=settings) as monitor:
                seen = await until(monitor, lambda s: s.state != STARTING, timeout_s=30)
                with pytest.raises(InitTimeout, match="stalled"):
                    await monitor.wait_ready(timeout_s=5)
        finally:
            server.stop()  # lets the stage's blocked read end, so that it stops at once
            await stage.stop(grace_s=1)
    finally:
        server.stop()
    failed = seen[-1][1]
    assert failed.state == FAILED, failed.message
    assert failed.message.startswith("stage stuck: download stalled: no progress for 1.")
    assert f"of {size / 1e6:.1f} MB" in failed.message and failed.bytes_done > 0
    started = next(t for t, s in seen if s.phase == stage_pb2.DOWNLOAD_START or s.paused)
    # The stall limit (1 s) ended it, well inside the 30 s budget.
    assert seen[-1][0] - started < settings.init_timeout_s / 2


async def test_a_device_lock_held_elsewhere_times_out_naming_the_phase(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    locks = tmp_path / "locks"
    stage: StageProcess | None = None
    async with lock_held(locks):
        try:
            runtime = {"device_lock": True, "lock_dir": str(locks), "stage_init_timeout_s": 60}
            config = tiny_config("queued", omni_cache_dir, runtime=runtime)
            stage = StageProcess(write_config(tmp_path / "queued.yaml", config))
            address = await stage.start()
            settings = WatchdogSettings(init_timeout_s=2.0, stall_timeout_s=5.0)
            async with monitoring("queued", address, settings=settings) as monitor:
                seen = await until(monitor, lambda s: s.state != STARTING, timeout_s=30)
        finally:
            if stage is not None:
                await stage.stop()
    failed = seen[-1][1]
    assert failed.state == FAILED and failed.phase == stage_pb2.DEVICE_LOCK_WAIT
    assert "stage queued: init timed out in phase DEVICE_LOCK_WAIT after 2." in failed.message
    assert "of a 2.0s budget" in failed.message and "neighbour" in failed.message
    waiting = [s for _, s in seen if s.phase == stage_pb2.DEVICE_LOCK_WAIT]
    assert waiting and not any(s.paused for s in waiting)  # the lock wait is never paused


async def spawn_on(config: Path, port: int) -> asyncio.subprocess.Process:
    """A stage on a given port (StageProcess always binds port 0)."""
    cmd = ["-m", "services.stage", "serve", "--config", str(config), "--port", str(port)]
    return await asyncio.create_subprocess_exec(
        sys.executable, *cmd, stdout=asyncio.subprocess.PIPE
    )


async def reap(proc: asyncio.subprocess.Process | None) -> None:
    if proc is None or proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 20)
    except TimeoutError:
        proc.kill()
        await proc.wait()


async def test_a_stage_through_its_life_late_start_kill_and_restart_on_its_port(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    """(One test, so that the slow part, starting stage processes, happens only twice.)"""
    with socket.socket() as probe:  # nothing listens here yet: the plain deadline runs
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    config = write_config(tmp_path / "phoenix.yaml", tiny_config("phoenix", omni_cache_dir))
    first = second = None
    settings = WatchdogSettings(init_timeout_s=120, stall_timeout_s=30)
    try:
        async with monitoring(
            "phoenix",
            address,
            settings=settings,
            reconnect_initial_s=0.1,
            reconnect_max_s=0.5,
            health_poll_s=0.2,
        ) as monitor:
            # Not reachable yet: STARTING, the budget counting down at least once a second.
            waiting = await until(monitor, lambda s: s.counted_s > 2.5, timeout_s=15)
            first = await spawn_on(config, port)
            came_up = await until(monitor, lambda s: s.state == READY, timeout_s=90)

            os.kill(first.pid, signal.SIGKILL)
            killed_at = asyncio.get_running_loop().time()
            went_down = await until(monitor, lambda s: s.state == DOWN, timeout_s=10)
            await first.wait()

            second = await spawn_on(config, port)
            assert second.stdout is not None
            line = await asyncio.wait_for(second.stdout.readline(), 90)
            assert line.decode().strip() == f"listening {address}"
            came_back = await until(monitor, lambda s: s.state == READY, timeout_s=90)
            assert monitor.ready
    finally:
        await reap(first)
        await reap(second)

    assert all(s.state == STARTING and not s.paused for _, s in waiting)
    lefts = [s.budget_left_s for _, s in waiting]
    assert len(lefts) >= 3 and lefts == sorted(lefts, reverse=True) and lefts[0] > lefts[-1]
    times = [t for t, _ in waiting]
    assert max(b - a for a, b in itertools.pairwise(times)) < 1.5
    assert "InitStatus unavailable (UNAVAILABLE)" in waiting[-1][1].message
    assert states(waiting + came_up) == [STARTING, READY]
    assert came_up[-1][1].counted_s > 2.5  # unreachable time is counted: no events, no pause

    down = went_down[-1][1]
    assert went_down[-1][0] - killed_at <= 3.0
    assert "stage phoenix" in down.message and address in down.message
    assert states(went_down) == [READY, DOWN]

    assert states(came_back) == [DOWN, STARTING, READY]
    assert came_back[-1][1].counted_s < came_up[-1][1].counted_s  # a fresh budget


async def test_stop_ends_the_monitor_when_a_change_lands_with_it() -> None:
    """A change (a replica came or went) in the same moment as stop(): the ticker
    must end, not take the change and swallow the cancel (asyncio.wait_for on 3.11
    does; the orchestrator's stop then hung)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"  # nothing listens: STARTING
    for _ in range(20):
        monitor = StageMonitor(
            StageTarget("quiet", address, WatchdogSettings(60, stall_timeout_s=60))
        )
        await monitor.start()
        await asyncio.sleep(0.05)  # the ticker waits for a change now
        monitor.replicas_changed()
        await asyncio.wait_for(monitor.stop(), 5)
