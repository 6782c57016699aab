"""When an idle scheduler stops gathering newcomers and starts its first step.

Requests that arrive together should share their prefill, but a lone request
must not wait for company that is not coming: its time to first token would be
spent on nothing. So the scheduler waits (up to ``gather_s`` after the first arrival)
only while more arrivals are likely: requests the stage has checked that are on
their way to ``submit`` (the stage checks each request just before it runs it),
or news (a check, an arrival) less than ``ARRIVAL_GAP_S`` ago, as in a burst
from one client. Plain Python with an injectable clock; the scheduler's lock
guards every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

# Requests sent together (one client opening a stream per request) reach the
# scheduler 0.2-4 ms apart here (benchmarks/stage_ttft.py, timestamps at check and
# submit): an idle scheduler keeps gathering while news comes at least this often.
ARRIVAL_GAP_S = 0.004


class Arrivals:
    def __init__(self, gather_s: float, clock: Callable[[], float]) -> None:
        self._gather_s = gather_s
        self._clock = clock
        self._expected: deque[float] = deque()  # when each request on its way was checked
        self._last_news = float("-inf")

    def expect(self) -> None:
        """A request was checked and is on its way."""
        self._last_news = self._clock()
        self._expected.append(self._last_news)

    def arrived(self) -> None:
        """A request was submitted (one that was expected, if any was)."""
        if self._expected:
            self._expected.popleft()
        self._last_news = self._clock()

    def wait_until(self, deadline: float) -> float:
        """Until when an idle scheduler should keep gathering (<= now: start now)."""
        now = self._clock()
        # One checked but never submitted (refused meanwhile) is forgotten.
        while self._expected and self._expected[0] < now - self._gather_s:
            self._expected.popleft()
        if self._expected:
            return deadline
        return min(deadline, self._last_news + ARRIVAL_GAP_S)
