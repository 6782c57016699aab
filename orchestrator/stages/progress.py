"""Live start-up progress for `omni up`: each stage's state, phase, download
bar and the watchdog's remaining budget, redrawn in place on a terminal and
printed line by line (on changes only) elsewhere."""

from __future__ import annotations

import sys
from typing import TextIO

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2

BAR = 24


def render(status: orchestrator_pb2.StageStatus) -> str:
    state = orchestrator_pb2.StageState.Name(status.state).removeprefix("STAGE_")
    phase = stage_pb2.InitPhase.Name(status.phase) if status.phase else "-"
    parts = [f"{status.name:<12}", f"{state:<8}", f"{phase:<20}"]
    if status.bytes_total and status.state == orchestrator_pb2.STAGE_STARTING:
        done = min(status.bytes_done / status.bytes_total, 1.0)
        filled = int(done * BAR)
        parts.append(
            f"[{'#' * filled}{'.' * (BAR - filled)}] "
            f"{status.bytes_done / 1e6:.1f}/{status.bytes_total / 1e6:.1f} MB"
        )
    if status.state == orchestrator_pb2.STAGE_STARTING:
        paused = " (paused)" if status.paused else ""
        parts.append(f"budget {status.budget_left_s:.0f}s of {status.budget_s:.0f}s{paused}")
    if status.message and status.state != orchestrator_pb2.STAGE_READY:
        parts.append(status.message)
    return " ".join(parts).rstrip()


class ProgressView:
    def __init__(self, names: list[str], out: TextIO = sys.stderr, tty: bool | None = None):
        self._names = names
        self._out = out
        self._tty = out.isatty() if tty is None else tty
        self._lines: dict[str, str] = {}
        self._phases: dict[str, tuple[int, int]] = {}
        self._drawn = 0

    def update(self, status: orchestrator_pb2.StageStatus) -> None:
        line = render(status)
        key = (status.state, status.phase)
        changed = self._phases.get(status.name) != key
        self._phases[status.name] = key
        self._lines[status.name] = line
        if self._tty:
            self._redraw()
        elif changed:
            print(line, file=self._out, flush=True)

    def _redraw(self) -> None:
        if self._drawn:
            self._out.write(f"\x1b[{self._drawn}F")  # back to the first line of the block
        for name in self._names:
            self._out.write("\x1b[2K" + self._lines.get(name, name) + "\n")
        self._drawn = len(self._names)
        self._out.flush()
