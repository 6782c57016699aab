"""One hibari voice loaded, and a text spoken by it the way the stage speaks:
sentence by sentence, each with a fresh generator from the request's seed, so a
sentence sounds the same whichever window brought it (and equals
``Hibari()(sentence, speed=speed, seed=seed)``)."""

from __future__ import annotations

import threading

import numpy as np
from hibari import SAMPLE_RATE, Hibari
from hibari.voices import voice_path

from services.mesh.errors import InitFailed


class Voice:
    sample_rate = SAMPLE_RATE

    def __init__(self, name: str, threads: int = 1) -> None:
        try:
            path = voice_path(name, download_missing=False)
        except FileNotFoundError:
            raise InitFailed(
                f"engine_args.voices: voice {name!r} is not in the package nor in hibari's "
                "cache (HIBARI_HOME); this stage downloads no voice by itself",
                field="engine_args.voices",
            ) from None
        self.name = name
        self._tts = Hibari(voice=name, model=path, threads=threads)
        # One synthesis at a time per voice: the G2P keeps state between calls.
        self._lock = threading.Lock()

    def speak(self, sentence: str, speed: float, seed: int) -> np.ndarray:
        """float32 mono samples in [-1, 1] at ``sample_rate`` (empty: nothing to say)."""
        with self._lock:
            audio: np.ndarray = self._tts(sentence, speed=speed, seed=seed)
        return audio

    def warm(self) -> None:
        self.speak("Warm up.", 1.0, 0)
