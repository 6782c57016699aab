"""The audio clock on a clock of its own: first packet, real-time factor and
underruns as playback started at the first packet would meet them."""

from __future__ import annotations

import pytest

from orchestrator.server.requests.audio_clock import AudioClock


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_packets_ahead_of_playback_never_underrun() -> None:
    clock = Clock()
    audio = AudioClock(clock)
    for at in (0.5, 0.6, 1.0, 2.9):  # each 1 s long: playback ends at 1.5, 2.5, 3.5, 4.5
        clock.now = 100.0 + at
        audio.heard("voice", 1.0)
    stream = audio.streams["voice"]
    assert stream.first_s == pytest.approx(0.5)
    assert stream.underruns == 0
    assert stream.seconds == pytest.approx(4.0)
    assert audio.real_time_factor("voice") == pytest.approx(2.9 / 4.0)


def test_a_late_packet_is_an_underrun_and_playback_resumes_from_it() -> None:
    clock = Clock()
    audio = AudioClock(clock)
    for at in (0.2, 1.0, 1.1, 1.3):  # 0.5 s each: dry at 0.7 (1.0 late), then 1.5 / 2.0 ahead
        clock.now = 100.0 + at
        audio.heard("voice", 0.5)
    assert audio.streams["voice"].underruns == 1
    assert audio.streams["voice"].ends_s == pytest.approx(2.5)  # resumed at 1.0, 3 x 0.5 s


def test_each_output_stage_has_its_own_stream() -> None:
    clock = Clock()
    audio = AudioClock(clock)
    clock.now = 101.0
    audio.heard("a", 0.1)
    clock.now = 103.0
    audio.heard("b", 0.1)
    audio.heard("a", 0.1)  # 2 s after a's first 0.1 s: an underrun of a, b untouched
    assert (audio.streams["a"].underruns, audio.streams["b"].underruns) == (1, 0)
    assert audio.streams["b"].first_s == pytest.approx(3.0)
