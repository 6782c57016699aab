"""The start-up view of `omni up`: per stage its state and phase, and while it
downloads a bar with percent, bytes, speed and ETA, then the watchdog's budget,
a short model name and what the stage says it is doing (verifying, unpacking,
converting).

On a terminal the block is redrawn in place and no line is ever wider than the
terminal (a line that would wrap breaks the redraw). Elsewhere (CI, container
logs) a line is printed on every phase change, and a progress line for each
stage still starting at least every ``heartbeat_s`` seconds.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO
from urllib.parse import urlsplit

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.units import format_bytes

BAR = 20
SPEED_WINDOW_S = 5.0  # bytes over this many seconds make the speed
STARTING = orchestrator_pb2.STAGE_STARTING
_DOWNLOADING = (stage_pb2.DOWNLOAD_START, stage_pb2.DOWNLOAD_PROGRESS)


def short_source(source: str) -> str:
    """A model name a person can read: the file or repo name, not the whole URL."""
    if not source:
        return ""
    parts = urlsplit(source)
    if parts.scheme == "hf":
        return f"{parts.netloc}{parts.path}".rsplit("/", 1)[-1]
    name = parts.path.rstrip("/").rsplit("/", 1)[-1] if parts.scheme else os.path.basename(source)
    return name or parts.netloc or source


def human_seconds(s: float) -> str:
    s = int(s + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class _Download:
    """Recent (time, bytes) samples of one stage's download: its speed."""

    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, done: int) -> None:
        if self.samples and done < self.samples[-1][1]:
            self.samples.clear()  # a new download (or a restart)
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= SPEED_WINDOW_S:
            self.samples.popleft()

    def speed(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else None


_PHASES = {
    stage_pb2.STARTING: "starting",
    stage_pb2.DEVICE_LOCK_WAIT: "device lock",
    stage_pb2.DEVICE_LOCK_ACQUIRED: "device locked",
    stage_pb2.DOWNLOAD_START: "downloading",
    stage_pb2.DOWNLOAD_PROGRESS: "downloading",
    stage_pb2.DOWNLOAD_DONE: "downloaded",
    stage_pb2.PREPARE: "preparing",
    stage_pb2.LOAD_START: "loading",
    stage_pb2.LOAD_DONE: "loaded",
    stage_pb2.MEMORY_PLANNED: "memory planned",
    stage_pb2.WARMUP: "warming up",
    stage_pb2.READY: "ready",
    stage_pb2.FAILED: "FAILED",
}


def render(status: orchestrator_pb2.StageStatus, speed: float | None = None) -> tuple[str, str]:
    """Two lines for one stage: what it is doing, and (while it downloads) how far."""
    if status.state == STARTING:
        doing = _PHASES.get(status.phase, "starting")
    else:
        doing = orchestrator_pb2.StageState.Name(status.state).removeprefix("STAGE_")
        doing = "ready" if status.state == orchestrator_pb2.STAGE_READY else doing
    head = [f"{status.name:<10}", f"{doing:<14}"]
    if status.state == STARTING:
        paused = " (paused)" if status.paused else ""
        head.append(f"budget {status.budget_left_s:.0f}/{status.budget_s:.0f}s{paused}")
    model = short_source(status.source)
    if model:
        head.append(model)
    message = status.message
    if message and status.state != orchestrator_pb2.STAGE_READY:
        if status.source and status.source in message:
            message = message.replace(status.source, model)  # never the whole URL
        head.append(f"- {message}")
    detail = ""
    if status.state == STARTING and status.phase in _DOWNLOADING:
        detail = f"{'':<10} {_download(status, speed)}"
    return " ".join(head).rstrip(), detail


def _download(status: orchestrator_pb2.StageStatus, speed: float | None) -> str:
    done, total = status.bytes_done, status.bytes_total
    rate = f"{format_bytes(speed)}/s" if speed else "-/s"
    if not total:
        return f"{format_bytes(done)}  {rate}"
    share = min(done / total, 1.0)
    filled = int(share * BAR)
    eta = f"eta {human_seconds((total - done) / speed)}" if speed else "eta -"
    bar = f"[{'#' * filled}{'.' * (BAR - filled)}]"
    return f"{bar} {share * 100:3.0f}%  {format_bytes(done)}/{format_bytes(total)}  {rate}  {eta}"


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: max(width - 1, 0)] + "…"


class ProgressView:
    def __init__(
        self,
        names: list[str],
        out: TextIO = sys.stderr,
        tty: bool | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_s: float = 10.0,
        width: Callable[[], int] | None = None,
    ) -> None:
        self._names = names
        self._out = out
        self._tty = out.isatty() if tty is None else tty
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._width = width or (lambda: shutil.get_terminal_size(fallback=(80, 24)).columns)
        self._statuses: dict[str, orchestrator_pb2.StageStatus] = {}
        self._downloads: dict[str, _Download] = {}
        self._phases: dict[str, tuple[int, int]] = {}
        self._printed_at: dict[str, float] = {}
        self._drawn = 0

    def update(self, status: orchestrator_pb2.StageStatus) -> None:
        now = self._clock()
        name = status.name
        if status.bytes_done or status.bytes_total:
            self._downloads.setdefault(name, _Download()).add(now, status.bytes_done)
        self._statuses[name] = status
        key = (status.state, status.phase)
        changed = self._phases.get(name) != key
        self._phases[name] = key
        if self._tty:
            self._redraw()
            return
        due = now - self._printed_at.get(name, now) >= self._heartbeat_s
        if changed or (due and status.state == STARTING):
            self._printed_at[name] = now
            print(self._line(name), file=self._out, flush=True)

    def _lines(self, name: str) -> tuple[str, str]:
        status = self._statuses.get(name)
        if status is None:
            return name, ""
        download = self._downloads.get(name)
        return render(status, download.speed() if download else None)

    def _line(self, name: str) -> str:
        head, detail = self._lines(name)
        return f"{head} | {detail.strip()}" if detail else head

    def _redraw(self) -> None:
        width = self._width() - 1  # a line exactly as wide as the terminal may wrap
        if self._drawn:
            self._out.write(f"\x1b[{self._drawn}F")  # back to the first line of the block
        for name in self._names:
            for line in self._lines(name):  # two lines a stage, so the block never moves
                self._out.write("\x1b[2K" + _fit(line, width) + "\n")
        self._drawn = 2 * len(self._names)
        self._out.flush()
