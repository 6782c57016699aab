"""The recogniser's reading of encoded audio (services/engines/whisper/audio.py),
with real codecs (PyAV's own encoders): what it hears of a WAV, an MP3 and an Ogg
Opus clip is what faster-whisper's own ``decode_audio`` hears of the same bytes,
within a bound taken from the two on the WAV, a damaged frame is skipped rather
than fatal, and a compressed clip that decodes past the limit is refused by
name (the bytes are small; the samples are not)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from faster_whisper.audio import decode_audio
from hibari import Hibari

from services.engines.base import MediaPart
from services.engines.whisper.audio import RATE, samples
from services.mesh import wav
from services.mesh.errors import InvalidArgument

SAID = "The little boat sailed across the lake before the storm came."
SOURCE_RATE = 24000


@pytest.fixture(scope="module")
def spoken() -> np.ndarray:
    return Hibari()(SAID, seed=0)


def encoded(audio: np.ndarray, container: str, codec: str, rate: int = SOURCE_RATE) -> bytes:
    """``audio`` (float mono at ``rate``) encoded by PyAV's ``codec``."""
    out = io.BytesIO()
    with av.open(out, "w", format=container) as box:
        stream = box.add_stream(codec, rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(audio[None, :].astype(np.float32), "flt", "mono")
        frame.sample_rate = rate
        step = stream.codec_context.frame_size or 1024
        for start in range(0, len(audio), step):  # frames the codec takes whole
            piece = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(audio[None, start : start + step], np.float32), "flt", "mono"
            )
            piece.sample_rate = rate
            for packet in stream.encode(piece):
                box.mux(packet)
        for packet in stream.encode(None):
            box.mux(packet)
    return out.getvalue()


def wav_bytes(audio: np.ndarray, rate: int = SOURCE_RATE) -> bytes:
    pcm = wav.pcm16(audio)
    return wav.header(rate, 1, len(pcm)) + pcm


def heard(data: bytes, media_type: str, max_s: float = 60.0) -> np.ndarray:
    return samples(MediaPart("audio", media_type, data), "part", max_s, 1e-3)


@pytest.mark.parametrize(
    ("container", "codec", "media_type"),
    [
        ("wav", "", "audio/wav"),
        ("mp3", "libmp3lame", "audio/mpeg"),
        ("ogg", "libopus", "audio/ogg"),
    ],
)
def test_a_clip_reads_as_faster_whisper_reads_it(
    spoken: np.ndarray, container: str, codec: str, media_type: str
) -> None:
    if container == "wav":
        data = wav_bytes(spoken)
    else:
        rate = 48000 if codec == "libopus" else SOURCE_RATE  # Opus codes 48 kHz only
        source = spoken
        if rate != SOURCE_RATE:
            source = np.interp(
                np.arange(len(spoken) * rate // SOURCE_RATE) * SOURCE_RATE / rate,
                np.arange(len(spoken)),
                spoken,
            ).astype(np.float32)
        data = encoded(source, container, codec, rate)
    ours = heard(data, media_type)
    theirs = decode_audio(io.BytesIO(data), sampling_rate=RATE)
    assert ours.dtype == np.float32
    # The same decoder and resampler; faster-whisper rounds to 16-bit on the way,
    # so the two differ by that rounding (a sample is within two 16-bit steps).
    assert len(ours) == len(theirs)
    assert float(np.abs(ours - theirs).max()) <= 2 / 32768
    # And it is the speech that was said: about as long, at 16 kHz.
    assert abs(len(ours) / RATE - len(spoken) / SOURCE_RATE) < 0.1


def _refuses_a_frame(data: bytes) -> bool:
    """Whether PyAV's decoder raises on some frame of ``data`` (and reads on after)."""
    with av.open(io.BytesIO(data)) as box:
        frames = box.decode(box.streams.audio[0])
        while True:
            try:
                next(frames)
            except StopIteration:
                return False
            except av.error.InvalidDataError:
                return True


def test_a_damaged_frame_is_skipped(spoken: np.ndarray) -> None:
    data = encoded(spoken, "adts", "aac")
    clean = heard(data, "audio/aac")
    rng = np.random.default_rng(0)
    for trial in range(200):  # junk over part of a frame, until the decoder refuses one
        damaged = bytearray(data)
        at = len(damaged) // 3 + 37 * trial
        damaged[at : at + 200] = rng.bytes(200)
        try:
            refuses = _refuses_a_frame(bytes(damaged))
        except av.FFmpegError:  # the junk broke the stream itself: try another
            continue
        if refuses:
            break
    else:
        pytest.fail("no junk made the decoder refuse a frame: the test proves nothing")
    read = heard(bytes(damaged), "audio/aac")
    assert 0.8 * len(clean) <= len(read) <= len(clean) + RATE // 10


def test_a_small_file_that_decodes_past_the_limit_is_refused_by_name(spoken: np.ndarray) -> None:
    long = np.tile(spoken, 8)  # ~24 s of speech, ~100 KB of MP3: under the byte guard
    data = encoded(long, "mp3", "libmp3lame")
    with pytest.raises(InvalidArgument) as refused:
        heard(data, "audio/mpeg", max_s=5.0)
    assert refused.value.field == "part.data"
    assert "over the limit of 5 s" in str(refused.value)


def test_bytes_that_are_not_audio_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument) as refused:
        heard(b"ID3 but no frames at all" * 10, "audio/mpeg")
    assert refused.value.field == "part.data" and "not audio" in str(refused.value)
