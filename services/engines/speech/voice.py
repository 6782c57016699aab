"""One hibari voice loaded, and a text spoken by it the way the stage speaks:
sentence by sentence, each with a fresh generator from the request's seed, so a
sentence sounds the same whichever window brought it (and equals
``Hibari()(sentence, speed=speed, seed=seed)``).

A hibari voice is one ONNX file (the whole model, about 8 MB; every voice has
the same architecture) plus the spelling-to-sound rules of its accent. A named
voice is the package's own file or one in hibari's cache; a voice the stage
fetched (``VoiceSource``) is that file, or the one ``.onnx`` file in the folder
or archive fetched."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from hibari import SAMPLE_RATE, Hibari
from hibari.voices import DEFAULT, voice_path

from services.mesh.errors import InitFailed

FIELD = "engine_args.voices"


class Voice:
    sample_rate = SAMPLE_RATE

    def __init__(self, name: str, tts: Hibari) -> None:
        self.name = name
        self._tts = tts
        # The G2P keeps state between calls: one spelling-to-sound at a time per
        # voice. The model (onnxruntime's run is thread-safe) and the vocoder run
        # outside it, so requests' sentences are synthesised side by side.
        self._g2p_lock = threading.Lock()

    @classmethod
    def named(cls, name: str, threads: int = 1) -> Voice:
        """One of hibari's voices, in the package or already in its cache."""
        try:
            path = voice_path(name, download_missing=False)
        except FileNotFoundError:
            raise InitFailed(
                f"{FIELD}: voice {name!r} is not in the package nor in hibari's cache "
                "(HIBARI_HOME); a name alone is never downloaded: give the voice as "
                "{name: ..., source: URL}",
                field=FIELD,
            ) from None
        return cls(name, Hibari(voice=name, model=path, threads=threads))

    @classmethod
    def from_file(cls, name: str, fetched: Path, british: bool, threads: int = 1) -> Voice:
        """The voice in a fetched file or folder, spoken with its accent's rules."""
        from hibari.g2p import G2P

        path = _onnx_in(name, fetched)
        try:
            tts = Hibari(voice=DEFAULT, model=str(path), threads=threads, g2p=G2P(british=british))
        except Exception as exc:  # onnxruntime's own error: the file is not a model
            raise InitFailed(
                f"{FIELD}: voice {name!r}: {path.name} is not a hibari voice ({exc})"[:1000],
                field=FIELD,
            ) from exc
        return cls(name, tts)

    def speak(self, sentence: str, speed: float, seed: int) -> np.ndarray:
        """float32 mono samples in [-1, 1] at ``sample_rate`` (empty: nothing to say):
        what ``Hibari.__call__`` returns (its phrases in order, one generator from
        ``seed`` through them), with only the G2P under the voice's lock."""
        tts = self._tts
        with self._g2p_lock:
            phrases = tts.phonemize(sentence)
        noise = np.random.default_rng(seed)
        parts = [tts.from_ids(tts.ids(phrase), speed, noise) for phrase in phrases]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def warm(self) -> None:
        self.speak("Warm up.", 1.0, 0)


def _onnx_in(name: str, fetched: Path) -> Path:
    if fetched.is_file():
        return fetched
    found = sorted(fetched.rglob("*.onnx"))
    if len(found) != 1:
        raise InitFailed(
            f"{FIELD}: voice {name!r}: expected one .onnx file in {fetched}, found "
            f"{len(found)} ({', '.join(p.name for p in found[:5])})",
            field=FIELD,
        )
    return found[0]
