"""The pausable init watchdog on a fake clock: every transition, no network."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.stages.watchdog import InitTimeout, Watchdog, WatchdogSettings
from services.mesh.errors import InitFailed
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2

P = stage_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Stage:
    """Feeds events to a watchdog as a stage would: monotonic offsets always grow."""

    def __init__(self, watchdog: Watchdog, clock: Clock, wall_s: int = 1_700_000_000) -> None:
        self.watchdog, self.clock, self.mono, self.wall_s = watchdog, clock, 0.0, wall_s
        self.sent: list[stage_pb2.InitEvent] = []

    def event(self, phase: int, after_s: float = 0.0, **fields: object) -> stage_pb2.InitEvent:
        self.clock.advance(after_s)
        self.mono += after_s + 0.001
        event = stage_pb2.InitEvent(stage="s", phase=phase, monotonic_s=self.mono, **fields)  # type: ignore[arg-type]
        event.wall_time.seconds = self.wall_s
        self.sent.append(event)
        self.watchdog.observe(event)
        return event


def make(
    init: float = 10.0, stall: float = 5.0, paused: frozenset[str] = frozenset({"download"})
) -> tuple[Watchdog, Clock, Stage]:
    clock = Clock()
    watchdog = Watchdog("thinker", WatchdogSettings(init, stall, paused), clock)
    return watchdog, clock, Stage(watchdog, clock)


def failure(watchdog: Watchdog) -> str:
    with pytest.raises((InitTimeout, InitFailed)) as caught:
        watchdog.check()
    return caught.value.message


def test_plain_deadline_counts_from_construction() -> None:
    watchdog, clock, _ = make(init=10)
    clock.advance(9.9)
    watchdog.check()
    assert watchdog.next_check_in() == pytest.approx(0.1)
    clock.advance(0.1)
    message = failure(watchdog)
    assert watchdog.state == orchestrator_pb2.STAGE_FAILED
    assert message == (
        "stage thinker: init timed out in phase none (no init event seen) after 10.0s "
        "counted (+ 0.0s paused) of a 10.0s budget"
    )
    assert watchdog.error is not None and watchdog.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    clock.advance(50)
    assert failure(watchdog) == message  # idempotent: the verdict and its numbers stay
    assert watchdog.counted_s == pytest.approx(10.0) and watchdog.next_check_in() is None


def test_download_pause_moves_the_deadline_by_the_paused_time() -> None:
    watchdog, clock, stage = make(init=10, stall=0)
    stage.event(P.STARTING, 2, message="engine transformers")
    stage.event(P.DOWNLOAD_START, 1, bytes_total=4_000_000, message="fetching x")
    assert watchdog.paused and watchdog.next_check_in() is None  # no stall limit
    clock.advance(95.2)
    assert watchdog.paused_s == pytest.approx(95.2) and watchdog.counted_s == pytest.approx(3)
    watchdog.check()
    stage.event(P.DOWNLOAD_DONE, 0, bytes_done=4_000_000, bytes_total=4_000_000)
    assert not watchdog.paused and watchdog.budget_left_s == pytest.approx(7)
    assert watchdog.next_check_in() == pytest.approx(7)
    stage.event(P.DEVICE_LOCK_WAIT, 1, message="waiting for device cpu, held by neighbour")
    clock.advance(6)
    message = failure(watchdog)
    assert message == (
        "stage thinker: init timed out in phase DEVICE_LOCK_WAIT after 10.0s counted "
        "(+ 95.2s paused for download) of a 10.0s budget "
        "(waiting for device cpu, held by neighbour)"
    )
    assert watchdog.phase == P.DEVICE_LOCK_WAIT


def test_device_lock_wait_is_never_paused() -> None:
    watchdog, _, stage = make(init=10, paused=frozenset({"download", "load"}))
    stage.event(P.STARTING)
    stage.event(P.DEVICE_LOCK_WAIT, 1)
    assert not watchdog.paused and watchdog.next_check_in() == pytest.approx(9)
    # A lock wait seen in the middle of a paused download ends that pause too.
    stage.event(P.DOWNLOAD_START, 1)
    assert watchdog.paused
    stage.event(P.DEVICE_LOCK_WAIT, 3)
    assert not watchdog.paused and watchdog.paused_s == pytest.approx(3)
    with pytest.raises(ValueError, match="device-lock wait is never paused"):
        WatchdogSettings(10, 5, frozenset({"download", "device_lock"}))


def test_load_pauses_only_when_configured() -> None:
    for paused, counted in ((frozenset({"download"}), 8.0), (frozenset({"download", "load"}), 3.0)):
        watchdog, _, stage = make(init=10, paused=paused)
        stage.event(P.STARTING)
        stage.event(P.LOAD_START, 3)
        assert watchdog.paused == ("load" in paused)
        stage.event(P.LOAD_DONE, 5)
        assert not watchdog.paused and watchdog.counted_s == pytest.approx(counted)
    watchdog, _, stage = make(init=10, paused=frozenset({"load"}))
    stage.event(P.DOWNLOAD_START)
    assert not watchdog.paused  # download itself can be left counted, too


def test_nested_and_duplicate_events_keep_one_pause() -> None:
    watchdog, _, stage = make(init=10, stall=0, paused=frozenset({"download", "load"}))
    stage.event(P.DOWNLOAD_START, 1)
    stage.event(P.DOWNLOAD_START, 2)  # a second file: the same pause goes on
    stage.event(P.DOWNLOAD_PROGRESS, 2, bytes_done=10)
    stage.event(P.LOAD_START, 2)  # DOWNLOAD_DONE missed: download pause ends, load's begins
    assert watchdog.paused and watchdog.paused_s == pytest.approx(6)
    stage.event(P.LOAD_START, 1)
    stage.event(P.LOAD_DONE, 1)
    stage.event(P.LOAD_DONE, 1)  # a close without an open pause changes nothing
    assert watchdog.paused_s == pytest.approx(8) and watchdog.counted_s == pytest.approx(2)
    stage.event(P.DOWNLOAD_DONE, 1)  # nor does a stray DONE
    assert not watchdog.paused and watchdog.counted_s == pytest.approx(3)
    assert failure_free(watchdog)


def failure_free(watchdog: Watchdog) -> bool:
    watchdog.check()
    return watchdog.state == orchestrator_pb2.STAGE_STARTING


def test_progress_resets_the_stall_timer_and_no_progress_fails_saying_stalled() -> None:
    watchdog, clock, stage = make(init=10, stall=30)
    stage.event(P.DOWNLOAD_START, 1, bytes_total=4_000_000)
    assert watchdog.next_check_in() == pytest.approx(30)  # paused: only the stall limit
    stage.event(P.DOWNLOAD_PROGRESS, 20, bytes_done=1_200_000, bytes_total=4_000_000)
    assert watchdog.next_check_in() == pytest.approx(30)
    assert watchdog.phase == P.DOWNLOAD_PROGRESS and watchdog.bytes_done == 1_200_000
    stage.event(P.DOWNLOAD_PROGRESS, 20, bytes_done=1_200_000)  # no more bytes: no reset
    assert watchdog.next_check_in() == pytest.approx(10)
    clock.advance(9.9)
    watchdog.check()
    clock.advance(0.1)
    message = failure(watchdog)
    assert message.startswith(
        "stage thinker: download stalled: no progress for 30.0s at 1.2 MB of 4.0 MB"
    )
    assert "(after 1.0s counted (+ 50.0s paused for download) of a 10.0s budget)" in message
    assert isinstance(watchdog.error, InitTimeout) and watchdog.error.stalled
    assert watchdog.state == orchestrator_pb2.STAGE_FAILED and not watchdog.paused


def test_stall_timer_runs_even_when_download_is_counted() -> None:
    watchdog, clock, stage = make(init=100, stall=5, paused=frozenset())
    stage.event(P.DOWNLOAD_START, 1)
    assert not watchdog.paused and watchdog.next_check_in() == pytest.approx(5)
    clock.advance(5)
    assert "download stalled: no progress for 5.0s at 0 B of an unknown size" in failure(watchdog)


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


def test_next_check_in_is_the_earliest_of_deadline_and_stall() -> None:
    watchdog, _, stage = make(init=10, stall=4, paused=frozenset())
    assert watchdog.next_check_in() == pytest.approx(10)
    stage.event(P.DOWNLOAD_START, 8)
    assert watchdog.next_check_in() == pytest.approx(2)  # deadline first
    watchdog, _, stage = make(init=10, stall=4, paused=frozenset())
    stage.event(P.DOWNLOAD_START, 1)
    assert watchdog.next_check_in() == pytest.approx(4)  # stall first
    stage.event(P.DOWNLOAD_DONE, 1)
    assert watchdog.next_check_in() == pytest.approx(8)  # no download, no stall limit


def test_status_fields() -> None:
    watchdog, _, stage = make(init=10, stall=30)
    stage.event(P.DOWNLOAD_START, 2, bytes_total=4000, message="fetching http://x/m.tar.gz")
    stage.event(P.DOWNLOAD_PROGRESS, 3, bytes_done=1000, bytes_total=4000)
    status = watchdog.status("127.0.0.1:5000")
    assert status == orchestrator_pb2.StageStatus(
        name="thinker",
        address="127.0.0.1:5000",
        state=orchestrator_pb2.STAGE_STARTING,
        phase=P.DOWNLOAD_PROGRESS,
        counted_s=2.0,
        paused_s=3.0,
        budget_s=10.0,
        budget_left_s=8.0,
        paused=True,
        bytes_done=1000,
        bytes_total=4000,
        message="fetching http://x/m.tar.gz",
    )


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="init_timeout_s"):
        WatchdogSettings(0, 5)
    with pytest.raises(ValueError, match="stall_timeout_s"):
        WatchdogSettings(1, -1)
    assert WatchdogSettings(1, 0).stall_limit_s is None
    assert WatchdogSettings(1, 2).paused_phases == frozenset({"download"})
