"""The time half of the init watchdog: one attempt's counted seconds, the pauses
that do not count (credited by phase family) and the stall timer of a download.

Plain arithmetic on the instants the watchdog passes in; it decides nothing about
events or states (``watchdog`` does). Once ``freeze``\\ d at the attempt's end,
every reading stays what it was at that instant.
"""

from __future__ import annotations


class InitClock:
    """``budget_s`` counted seconds from ``start``; ``stall_limit_s``: None for no limit."""

    def __init__(self, budget_s: float, stall_limit_s: float | None, start: float) -> None:
        self.budget_s = budget_s
        self.stall_limit_s = stall_limit_s
        self._start = start
        self._ended: float | None = None  # when the attempt ended: readings freeze there
        self._credited: dict[str, float] = {}  # paused seconds per family, closed pauses
        self._pause: tuple[str, float] | None = None  # (family, since)
        self.stall_since: float | None = None  # None: no download seen live right now

    # --- pauses ---------------------------------------------------------------------

    @property
    def pausing(self) -> str | None:
        """The family of the pause in progress, if one is."""
        return self._pause[0] if self._pause is not None else None

    def pause(self, family: str, now: float) -> None:
        if self._pause is None:
            self._pause = (family, now)

    def end_pause(self, now: float) -> None:
        """Credit the pause in progress (if any) up to ``now``."""
        if self._pause is None:
            return
        family, since = self._pause
        self._credited[family] = self._credited.get(family, 0.0) + (now - since)
        self._pause = None

    def freeze(self, now: float) -> None:
        """The attempt ended at ``now``: nothing counts, pauses or stalls after it."""
        self.end_pause(now)
        self.stall_since = None
        self._ended = now

    # --- readings -------------------------------------------------------------------

    def reading_at(self, now: float) -> float:
        """``now``, or the instant the attempt ended if it has."""
        return self._ended if self._ended is not None else now

    def paused_at(self, now: float) -> float:
        open_s = now - self._pause[1] if self._pause is not None else 0.0
        return sum(self._credited.values()) + open_s

    def counted_at(self, now: float) -> float:
        return now - self._start - self.paused_at(now)

    def budget_left_at(self, now: float) -> float:
        return max(0.0, self.budget_s - self.counted_at(now))

    def stall_left_at(self, now: float) -> float | None:
        if self.stall_limit_s is None or self.stall_since is None:
            return None
        return self.stall_since + self.stall_limit_s - now

    def stalled_at(self, now: float) -> bool:
        left = self.stall_left_at(now)
        return left is not None and left <= 0

    def timed_out_at(self, now: float) -> bool:
        """The budget is spent (never while a pause is in progress)."""
        return self._pause is None and self.counted_at(now) >= self.budget_s

    def next_check_in(self, now: float) -> float | None:
        """Seconds until the budget or the stall limit could first run out; None when
        neither can (paused with no stall limit)."""
        candidates = [] if self._pause is not None else [self.budget_left_at(now)]
        stall_left = self.stall_left_at(now)
        if stall_left is not None:
            candidates.append(stall_left)
        return max(0.0, min(candidates)) if candidates else None

    def budget_text(self, now: float) -> str:
        """How the budget was spent by ``now``, for a failure's message."""
        credited = dict(self._credited)
        if self._pause is not None:
            credited[self._pause[0]] = credited.get(self._pause[0], 0.0) + now - self._pause[1]
        parts = [f"{s:.1f}s paused for {family}" for family, s in sorted(credited.items())]
        paused = ", ".join(parts) if parts else "0.0s paused"
        return (
            f"after {self.counted_at(now):.1f}s counted (+ {paused}) "
            f"of a {self.budget_s:.1f}s budget"
        )
