"""The init watchdog's verdicts on a fake clock: READY and FAILED, a late READY
taken back, a lost InitStatus stream, replays and a new stage process; no network."""

from __future__ import annotations

import grpc
import pytest

from services.mesh.errors import InitFailed
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from tests.helpers.init_events import Stage, failure, make

P = stage_pb2


def test_a_late_event_does_not_rescue_a_stage_whose_time_is_up() -> None:
    watchdog, _, stage = make(init=10)
    stage.event(P.STARTING)
    stage.event(P.LOAD_START, 10.5)  # nobody called check() in time; the verdict is the same
    assert watchdog.state == orchestrator_pb2.STAGE_FAILED
    assert "init timed out in phase STARTING after 10.5s counted" in failure(watchdog)


def test_a_timed_out_stage_that_reaches_ready_is_taken_back() -> None:
    watchdog, clock, stage = make(init=10)
    stage.event(P.STARTING)
    clock.advance(11)
    assert "init timed out" in failure(watchdog)
    stage.event(P.READY, 30)
    assert watchdog.state == orchestrator_pb2.STAGE_READY and watchdog.error is None
    assert watchdog.message.startswith("ready 30.0s after its process started, late: taken back")
    assert "init timed out in phase STARTING" in watchdog.message
    watchdog.check()  # nothing to raise any more


def test_a_late_ready_seen_at_the_deadline_is_taken_back_too() -> None:
    watchdog, _, stage = make(init=10)
    stage.event(P.STARTING)
    stage.event(P.READY, 10.5)  # the deadline passed before READY arrived: late, not lost
    assert watchdog.state == orchestrator_pb2.STAGE_READY
    assert "taken back" in watchdog.message


def test_a_stage_that_reported_failed_is_not_taken_back() -> None:
    watchdog, _, stage = make(init=10)
    stage.event(P.STARTING)
    stage.event(P.FAILED, 1, reason="no such model")
    stage.event(P.READY, 2)
    assert watchdog.state == orchestrator_pb2.STAGE_FAILED
    assert "no such model" in failure(watchdog)


def test_stream_lost_mid_download_keeps_the_credit_and_runs_the_plain_deadline() -> None:
    watchdog, clock, stage = make(init=10, stall=5)
    stage.event(P.STARTING, 1)
    stage.event(P.DOWNLOAD_START, 1)
    stage.event(P.DOWNLOAD_PROGRESS, 3, bytes_done=100)
    clock.advance(2)
    watchdog.stream_lost()
    assert not watchdog.paused and watchdog.paused_s == pytest.approx(5)
    assert watchdog.next_check_in() == pytest.approx(8)  # blind: no stall limit, only the deadline
    clock.advance(7)
    watchdog.check()  # 9 s counted
    # The stream comes back: the replay changes nothing, the next live progress
    # re-opens the pause and re-arms the stall timer.
    for old in list(stage.sent):
        watchdog.observe(old)
    assert not watchdog.paused and watchdog.counted_s == pytest.approx(9)
    stage.event(P.DOWNLOAD_PROGRESS, 0.5, bytes_done=100)
    assert watchdog.paused and watchdog.next_check_in() == pytest.approx(5)
    clock.advance(4)
    stage.event(P.DOWNLOAD_DONE, 0, bytes_done=200, bytes_total=200)
    assert watchdog.counted_s == pytest.approx(9.5) and watchdog.paused_s == pytest.approx(9)
    assert watchdog.next_check_in() == pytest.approx(0.5)


def test_stream_lost_before_any_event_is_the_plain_deadline() -> None:
    watchdog, clock, _ = make(init=10)
    clock.advance(4)
    watchdog.stream_lost("InitStatus unavailable (UNAVAILABLE)")
    assert watchdog.message == "InitStatus unavailable (UNAVAILABLE)"
    assert watchdog.next_check_in() == pytest.approx(6)
    clock.advance(6)
    assert "in phase none (no init event seen) after 10.0s counted" in failure(watchdog)


def test_ready_stops_everything() -> None:
    watchdog, clock, stage = make(init=10, stall=5)
    stage.event(P.DOWNLOAD_START, 1)
    stage.event(P.READY, 3, message="warm-up took 5 ms")
    assert watchdog.state == orchestrator_pb2.STAGE_READY and watchdog.next_check_in() is None
    clock.advance(1000)
    watchdog.check()
    assert watchdog.counted_s == pytest.approx(1) and watchdog.paused_s == pytest.approx(3)
    stage.event(P.FAILED, 1, reason="late")  # an attempt over stays over
    assert watchdog.state == orchestrator_pb2.STAGE_READY
    assert watchdog.message == "warm-up took 5 ms"


def test_failed_carries_the_stage_reason() -> None:
    watchdog, clock, stage = make(init=10)
    stage.event(P.LOAD_START, 1)
    stage.event(P.FAILED, 1, reason="ValueError: hidden_size many")
    message = failure(watchdog)
    assert message == "stage thinker: init failed: ValueError: hidden_size many"
    assert isinstance(watchdog.error, InitFailed)
    assert watchdog.error.code == grpc.StatusCode.UNAVAILABLE
    assert watchdog.phase == P.FAILED and watchdog.next_check_in() is None
    clock.advance(100)
    assert failure(watchdog) == message  # not turned into a timeout later


def test_replayed_events_are_ignored() -> None:
    watchdog, clock, stage = make(init=10)
    stage.event(P.STARTING, 1)
    stage.event(P.DOWNLOAD_START, 1)
    stage.event(P.DOWNLOAD_DONE, 4)
    snapshot = (watchdog.counted_s, watchdog.paused_s, watchdog.phase)
    clock.advance(1)
    for old in stage.sent:  # a fresh InitStatus from the same process
        watchdog.observe(old)
    assert not watchdog.paused and watchdog.phase == P.DOWNLOAD_DONE
    assert (watchdog.counted_s - 1, watchdog.paused_s) == pytest.approx(snapshot[:2])


def test_a_new_process_is_followed_only_after_restart() -> None:
    watchdog, clock, stage = make(init=10)
    stage.event(P.STARTING, 1)
    stage.event(P.DOWNLOAD_START, 1)
    stage.event(P.READY, 2)
    assert not watchdog.is_new_process(stage.sent[0])  # the same process, replaying
    second = Stage(watchdog, clock, wall_s=stage.wall_s + 60)
    clock.advance(30)
    starting = second.event(P.STARTING)
    assert watchdog.is_new_process(starting)
    assert watchdog.state == orchestrator_pb2.STAGE_READY  # ignored so far
    watchdog.restart()
    assert watchdog.attempt == 1 and watchdog.state == orchestrator_pb2.STAGE_STARTING
    assert watchdog.counted_s == 0 and watchdog.paused_s == 0
    watchdog.observe(starting)
    assert watchdog.phase == P.STARTING and not watchdog.is_new_process(starting)
    second.event(P.READY, 2)
    assert watchdog.state == orchestrator_pb2.STAGE_READY and watchdog.counted_s == 2


def test_a_process_seen_after_the_verdict_is_new() -> None:
    watchdog, clock, stage = make(init=1)
    clock.advance(1)
    failure(watchdog)  # timed out before any event was seen
    late = stage.event(P.STARTING)
    assert watchdog.is_new_process(late)


def test_mark_ready_is_readiness_learnt_from_health() -> None:
    watchdog, clock, _ = make(init=10)
    clock.advance(2)
    watchdog.mark_ready("ready per grpc health")
    assert watchdog.state == orchestrator_pb2.STAGE_READY and watchdog.counted_s == 2
