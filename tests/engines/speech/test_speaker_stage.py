"""The speaker stage over real gRPC: its audio is hibari's own, bit for bit;
segments of one request join into the whole utterance; token windows from a
thinker are spoken sentence by sentence without splitting a sentence or a
character; bad input is refused by name while the stream's other requests go on."""

from __future__ import annotations

import io
import itertools
import wave

import numpy as np
import pytest
from google.protobuf import struct_pb2
from hibari import Hibari
from transformers import AutoTokenizer

from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.startup.fetch.local import resolve_package_file
from tests.engines.speech.conftest import GGUF
from tests.helpers.stage import Result, collect

THREE = "The sea is wide and deep. Fish swim in it all day. Waves roll onto the sand."


def submit(
    rid: str,
    text: str = "",
    token_ids: list[int] | None = None,
    seq: int = 0,
    last: bool = True,
    **extra: object,
) -> stage_pb2.StageInput:
    params = stage_pb2.GenerationParams()
    if extra:
        params.extra.CopyFrom(struct_pb2.Struct())
        params.extra.update(extra)
    inputs = stage_pb2.StageInputs(text=text, token_ids=token_ids or [])
    return stage_pb2.StageInput(
        submit=stage_pb2.Submit(
            request_id=rid, inputs=inputs, params=params, sequence=seq, is_last=last
        )
    )


def audio_pieces(result: Result) -> list[np.ndarray]:
    pieces = []
    for segment in result.segments:
        for tensor in segment.tensors:
            assert tensor.name == "audio" and tensor.dtype == "float32"
            assert segment.audio_format.sample_rate == 24000
            assert segment.audio_format.channels == 1
            pieces.append(np.frombuffer(tensor.raw, dtype="<f4"))
    return pieces


async def run(client: StageClient, *inputs: stage_pb2.StageInput) -> dict[str, Result]:
    call = client.open_stream()
    for message in inputs:
        await call.write(message)
    await call.done_writing()
    return await collect(call)


def one_by_one(hibari: Hibari, text: str, seed: int = 0) -> list[np.ndarray]:
    return [hibari(s, seed=seed) for s in Hibari.split_sentences(text)]


@pytest.fixture(scope="module")
def tokenizer():
    gguf = resolve_package_file(GGUF)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


async def test_a_sentence_is_hibaris_own_audio(speaker, hibari) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    result = (await run(speaker, submit("one", text, speed=1.25)))["one"]
    assert result.error is None, result.error
    (audio,) = audio_pieces(result)
    # Bit-equal: the same model, the same seed, the same float32 samples sent raw.
    assert np.array_equal(audio, hibari(text, speed=1.25, seed=0))


async def test_segments_join_into_the_sentences_one_by_one(speaker, hibari) -> None:
    result = (await run(speaker, submit("three", THREE)))["three"]
    pieces = audio_pieces(result)
    expected = one_by_one(hibari, THREE)
    assert len(pieces) == len(expected) == 3  # one segment per sentence, in order
    assert np.array_equal(np.concatenate(pieces), np.concatenate(expected))


async def test_the_wav_blob_reads_back(speaker, hibari) -> None:
    result = (await run(speaker, submit("wav", THREE, return_wav=True)))["wav"]
    blobs = [b for s in result.segments for b in s.blobs]
    assert [(b.name, b.media_type) for b in blobs] == [("audio", "audio/wav")]
    samples = sum(len(p) for p in audio_pieces(result))
    with wave.open(io.BytesIO(blobs[0].data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == samples
        pcm = np.frombuffer(w.readframes(samples), dtype="<i2")
    whole = np.concatenate(one_by_one(hibari, THREE))
    assert np.array_equal(pcm, (np.clip(whole, -1, 1) * 32767).astype("<i2"))


async def test_token_windows_speak_each_sentence_once_and_whole(speaker, hibari, tokenizer) -> None:
    # A sentence cut over two windows, and "Å" whose bytes span two tokens cut
    # between them: what is spoken is the whole text's sentences, nothing garbled.
    text = "The Ångström unit is small. It measures atoms."
    ids = tokenizer(text)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    split = next(i for i, p in enumerate(pieces) if p.endswith("\ufffd")) + 1
    assert "\ufffd" in tokenizer.decode(ids[:split])  # the cut is inside the character
    cuts = [0, split, split + 5, len(ids)]  # window 2 ends mid-sentence
    windows = [
        submit("w", token_ids=ids[a:b], seq=n, last=False)
        for n, (a, b) in enumerate(itertools.pairwise(cuts))
    ]
    result = (await run(speaker, *windows, submit("w", seq=len(windows), last=True)))["w"]
    assert result.error is None, result.error
    spoken = audio_pieces(result)
    expected = one_by_one(hibari, text)
    assert len(spoken) == len(expected) == 2
    assert all(np.array_equal(a, b) for a, b in zip(spoken, expected, strict=True))


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (submit("bad", "Hello there.", voice="nobody"), "params.extra.voice"),
        (submit("bad", "Hello there.", speed=3.0), "params.extra.speed"),
        (submit("bad", "Hello there.", speed=0.25), "params.extra.speed"),
        (submit("bad", "   "), "inputs.text"),
        (submit("bad", "Word. " * 100), "inputs.text"),  # 600 characters, the limit is 400
        (submit("bad", "Hello there.", return_wav="yes"), "params.extra.return_wav"),
    ],
)
async def test_bad_input_is_refused_by_name_while_others_go_on(speaker, message, field) -> None:
    results = await run(speaker, message, submit("good", "Still here."))
    bad, good = results["bad"], results["good"]
    assert bad.error is not None and bad.error.code_name == "INVALID_ARGUMENT"
    assert bad.error.field == field
    assert good.error is None and good.completed is not None and audio_pieces(good)


async def test_an_answer_longer_than_the_limit_is_spoken_window_by_window(speaker, hibari) -> None:
    # The limit (400 characters here) bounds one window, not the answer: a thinker
    # that writes more than it must not fail at the speaker after its work is done.
    windows = [f"Part {n} is here. " + "The sea is wide. " * 8 for n in range(3)]
    whole = "".join(windows)
    assert len(whole) > 400 and all(len(w) < 400 for w in windows)
    inputs = [submit("long", w, seq=n, last=False) for n, w in enumerate(windows)]
    result = (await run(speaker, *inputs, submit("long", seq=len(windows), last=True)))["long"]
    assert result.error is None, result.error
    spoken = np.concatenate(audio_pieces(result))
    assert np.array_equal(spoken, np.concatenate(one_by_one(hibari, whole.strip())))
    # A WAV of the whole is held to the end: then the whole text counts, named.
    inputs = [submit("wav", w, seq=n, last=False, return_wav=True) for n, w in enumerate(windows)]
    refused = (await run(speaker, *inputs))["wav"]
    assert refused.error is not None and refused.error.field == "inputs.text"
    assert "return_wav" in refused.error.message
