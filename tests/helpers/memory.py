"""A process's memory as the kernel counts it (Linux /proc): resident now, and its
peak since a reset, so a test sees a burst's high-water mark without sampling it."""

from __future__ import annotations

from pathlib import Path

MB = 1_000_000


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{key} not in /proc/{pid}/status")


def rss(pid: int) -> int:
    """Resident bytes now."""
    return _status(pid, "VmRSS")


def reset_peak(pid: int) -> None:
    """Start the peak over from what is resident now (Linux 4.0+)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak(pid: int) -> int:
    """Peak resident bytes since the process started or the last ``reset_peak``."""
    return _status(pid, "VmHWM")
