"""The init watchdog's budget on a fake clock: what counts, what pauses, when a
download stalls, what the status says; no network."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.server.stages.watchdog import InitTimeout, WatchdogSettings
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from tests.helpers.init_events import failure, failure_free, make

P = stage_pb2


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
