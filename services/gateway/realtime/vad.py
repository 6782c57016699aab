"""Server VAD: where a speaker's turn starts and ends in the input audio, from
Silero VAD (silero.py: the model as the ``silero-vad`` wheel ships it, run by
onnxruntime; nothing downloaded). It scores 32 ms frames at 16 kHz, so each 32 ms of
the session's 24 kHz input is resampled (linearly: what it scores is speech,
under 8 kHz) before it is scored. A turn starts at the first frame at or over
``threshold`` and ends after ``silence_duration_ms`` of frames under it; times
are milliseconds of audio since the session began, as OpenAI's events count.

Between the two, ``PAUSE_MS`` of quiet says ``paused`` (speech again after it:
``resumed``): not OpenAI events, but the session's cue to start hearing the turn
so far before the silence window closes it (transcripts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from services.gateway.realtime.session_config import RATE, SemanticVadSettings, ServerVadSettings
from services.gateway.realtime.silero import RATE as VAD_RATE
from services.gateway.realtime.silero import WINDOW, Silero

FRAME = WINDOW * RATE // VAD_RATE  # 768 input samples: one 512-sample window at 16 kHz
FRAME_MS = 1000 * FRAME // RATE  # 32
_AT = np.linspace(0, FRAME - 1, WINDOW)  # where the 16 kHz samples fall in a frame
# Quiet after which the turn is likely over: a pause between words is shorter
# (~100-150 ms), the silence window longer (500 ms by default).
PAUSE_MS = 6 * FRAME_MS


@dataclass(frozen=True)
class Turn:
    kind: Literal["started", "paused", "resumed", "stopped"]
    ms: int  # audio_start_ms / audio_end_ms


class ServerVad:
    def __init__(
        self, settings: ServerVadSettings | SemanticVadSettings, start_ms: int = 0
    ) -> None:
        """``start_ms``: the session's audio before this VAD was turned on."""
        self.settings = settings
        self._detector = Silero()
        self._carry = b""  # under one frame, kept for the next append
        self._ms = start_ms  # audio scored so far, since the session began
        self.speaking = False
        self._silent_ms = 0
        self._paused = False

    def feed(self, pcm: bytes) -> list[Turn]:
        """Score ``pcm`` (16-bit, 24 kHz) frame by frame; the turns it starts or ends."""
        data = self._carry + pcm
        whole = len(data) // (2 * FRAME) * 2 * FRAME
        self._carry = data[whole:]
        if not whole:
            return []
        samples = np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0
        turns: list[Turn] = []
        grid = np.arange(FRAME)
        for frame in samples.reshape(-1, FRAME):
            speech = self._detector.score(np.interp(_AT, grid, frame))
            turns.extend(self._step(speech >= self.settings.threshold))
        return turns

    def _step(self, speech: bool) -> list[Turn]:
        start = self._ms
        self._ms += FRAME_MS
        if speech:
            self._silent_ms = 0
            if not self.speaking:
                self.speaking = True
                return [Turn("started", start)]
            if self._paused:
                self._paused = False
                return [Turn("resumed", start)]
            return []
        if self.speaking:
            self._silent_ms += FRAME_MS
            if self._silent_ms >= self.settings.silence_duration_ms:
                self.speaking = self._paused = False
                self._silent_ms = 0
                return [Turn("stopped", self._ms)]
            if self._silent_ms == PAUSE_MS:
                self._paused = True
                return [Turn("paused", self._ms)]
        return []

    @property
    def ms(self) -> int:
        return self._ms
