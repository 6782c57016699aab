"""When an idle step loop stops gathering, on a fake clock: at once for a lone
request (but for the short gap a burst's next arrival fits in), later for
requests announced as on their way, never past gather_s."""

from __future__ import annotations

import pytest

from services.engines.scheduler.arrivals import ARRIVAL_GAP_S, Arrivals


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lone_arrival_waits_only_the_gap() -> None:
    clock = Clock()
    arrivals = Arrivals(gather_s=10.0, clock=clock)
    arrivals.arrived()
    assert arrivals.wait_until(clock.now + 10.0) == pytest.approx(clock.now + ARRIVAL_GAP_S)


def test_announced_requests_are_waited_for_up_to_the_deadline() -> None:
    clock = Clock()
    arrivals = Arrivals(gather_s=10.0, clock=clock)
    arrivals.expect()
    arrivals.expect()
    arrivals.arrived()
    deadline = clock.now + 10.0
    assert arrivals.wait_until(deadline) == deadline  # one more is on its way
    clock.now += 1.0
    arrivals.arrived()
    assert arrivals.wait_until(deadline) == pytest.approx(clock.now + ARRIVAL_GAP_S)


def test_an_announced_request_that_never_comes_is_forgotten_after_gather_s() -> None:
    clock = Clock()
    arrivals = Arrivals(gather_s=0.05, clock=clock)
    arrivals.expect()  # refused after its check, say
    clock.now += 0.06
    arrivals.arrived()
    assert arrivals.wait_until(clock.now + 0.05) == pytest.approx(clock.now + ARRIVAL_GAP_S)


def test_the_gap_never_runs_past_the_deadline() -> None:
    clock = Clock()
    arrivals = Arrivals(gather_s=0.0, clock=clock)
    arrivals.arrived()
    assert arrivals.wait_until(clock.now) == clock.now  # gather_ms 0: no wait at all
