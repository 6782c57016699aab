"""Thinker → speaker through a real orchestrator and real stage processes (the
real SmolLM2, the real voice): the client's WAV grows as sentences are spoken,
holds exactly hibari's audio of the answer's sentences, and stays a valid WAV
when the request is cancelled mid-speech."""

from __future__ import annotations

import asyncio
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from hibari import Hibari

from orchestrator.client import Result
from services.mesh import wav
from services.testing.configs import stage_config
from tests.engines.speech.conftest import speaker_config
from tests.orchestrator.conftest import Stages, orchestrator, pipeline

EDGE = {"from": "thinker", "to": "speaker", "window": 4, "first_window": 2, "transform": "tokens"}
PROMPT = "Tell me about the sea in three sentences."


@pytest.fixture(scope="module")
async def mesh(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Stages]:
    stages = Stages(tmp_path_factory.mktemp("speech"))
    thinker = stage_config(
        "thinker",
        omni_cache_dir,
        defaults={"temperature": 0.0, "max_tokens": 64},
        segmenting={"max_segment_tokens": 4, "min_flush_interval_ms": 50},
        runtime={"torch_threads": 1},
    )
    try:
        await stages.start(
            {
                "thinker": thinker,
                "speaker": speaker_config(str(omni_cache_dir), max_text_chars=4000),
            }
        )
        yield stages
    finally:
        await stages.stop()


def read_wav(path: Path) -> tuple[wave._wave_params, np.ndarray]:
    with wave.open(str(path)) as w:
        return w.getparams(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


async def test_the_answer_is_spoken_into_a_growing_wav(mesh: Stages, tmp_path: Path) -> None:
    config = pipeline(mesh, ["thinker", "speaker"], [EDGE], outputs=["thinker", "speaker"])
    async with orchestrator(config) as (_, client):
        result = Result(audio_dir=tmp_path)
        sizes = []
        async for event in client.generate(PROMPT, request_id="sea"):
            result.add(event)
            if event.WhichOneof("kind") == "segment" and event.segment.tensors:
                sizes.append((tmp_path / "sea-speaker.wav").stat().st_size)
    assert result.ok, result.done
    assert len(sizes) >= 2 and sizes == sorted(sizes)  # grew with each sentence
    params, pcm = read_wav(tmp_path / "sea-speaker.wav")
    assert (params.framerate, params.nchannels, params.sampwidth) == (24000, 1, 2)
    answer = result.stages["thinker"].text
    tts = Hibari()
    expected = [tts(s, seed=0) for s in Hibari.split_sentences(answer)]
    # Exactly hibari's sentences of the answer: none lost, doubled or cut at a window.
    assert np.array_equal(pcm, np.frombuffer(wav.pcm16(np.concatenate(expected)), dtype="<i2"))
    assert np.abs(pcm).max() > 3000  # speech, not silence


async def test_cancel_mid_speech_stops_the_audio_and_leaves_a_valid_partial_wav(
    mesh: Stages, tmp_path: Path
) -> None:
    config = pipeline(mesh, ["thinker", "speaker"], [EDGE], outputs=["thinker", "speaker"])
    async with orchestrator(config) as (_, client):
        whole = await client.generate(PROMPT, request_id="whole").collect()
        result, aborted = Result(audio_dir=tmp_path), False
        async for event in client.generate(PROMPT, request_id="cut"):
            result.add(event)
            if event.WhichOneof("kind") == "segment" and event.segment.tensors and not aborted:
                aborted = True  # at the first sentence spoken
                asyncio.get_running_loop().create_task(client.abort("cut"))
    assert whole.ok and result.done is not None and result.done.code_name == "CANCELLED"
    said = np.concatenate(
        [np.frombuffer(t.raw, "<f4") for t in whole.stages["speaker"].tensors["audio"]]
    )
    params, pcm = read_wav(tmp_path / "cut-speaker.wav")
    spoken = sum(len(t.raw) // 4 for t in result.stages["speaker"].tensors["audio"])
    # A valid WAV of all that came, and no more came than the answer's first sentences.
    assert params.framerate == 24000 and params.nframes == len(pcm) == spoken > 0
    assert spoken < len(said)  # the audio stopped (greedy: the same answer, uncut)
    assert np.array_equal(pcm, np.frombuffer(wav.pcm16(said[:spoken]), dtype="<i2"))
