"""A recogniser request's audio: the content parts of its last user message that
hold audio, read as float32 mono at Whisper's 16 kHz. Each bad clip is refused
naming its part (``inputs.messages[0].parts[1].data``): bytes that are not audio,
a rate too low to hold speech, a clip over the limit, silence."""

from __future__ import annotations

import io
from collections.abc import Iterator
from itertools import chain
from typing import Any

import numpy as np

from services.engines.base import EngineRequest, MediaPart
from services.engines.request_checks import refuse

RATE = 16000  # what Whisper hears
MIN_RATE = 8000  # telephone speech; below it the words are gone


def user_audio(request: EngineRequest) -> list[tuple[str, MediaPart]]:
    """The audio parts of the last user message, with where each is."""
    for t in range(len(request.turns) - 1, -1, -1):
        turn = request.turns[t]
        if turn.role == "user":
            return [
                (f"inputs.messages[{t}].parts[{p}]", part)
                for p, part in enumerate(turn.parts)
                if isinstance(part, MediaPart) and part.kind == "audio"
            ]
    return []


def samples(part: MediaPart, where: str, max_s: float, min_peak: float) -> np.ndarray:
    """``part`` as float32 mono at 16 kHz, checked."""
    if part.media_type == "audio/pcm":
        if part.pcm is None or part.pcm.dim() != 1:
            refuse(f"{where}.pcm", "expected float32 mono samples [n]")
        if part.sample_rate < MIN_RATE:
            refuse(
                f"{where}.sample_rate",
                f"{part.sample_rate} Hz is too low for speech (at least {MIN_RATE} Hz)",
            )
        if part.pcm.numel() > max_s * part.sample_rate:
            refuse(f"{where}.pcm", _too_long(part.pcm.numel() / part.sample_rate, max_s))
        audio = _resample(part.pcm.float().numpy(), part.sample_rate)
    else:
        audio = _decoded(part, where, max_s)
    if len(audio) > max_s * RATE:
        refuse(f"{where}.data", _too_long(len(audio) / RATE, max_s))
    if not len(audio) or float(np.abs(audio).max()) < min_peak:
        field = f"{where}.pcm" if part.media_type == "audio/pcm" else f"{where}.data"
        refuse(field, "the audio is silent: no speech to transcribe")
    return audio


def _decoded(part: MediaPart, where: str, max_s: float) -> np.ndarray:
    """Encoded audio (WAV, MP3, Opus, FLAC, ...) decoded by PyAV and resampled by
    libswresample to 16 kHz mono float32, in one pass over the data that stops as
    soon as the clip runs past ``max_s``. (faster-whisper's ``decode_audio`` does
    the same and then runs a full ``gc.collect()``: ~0.2 s holding the GIL in a
    process with torch loaded, once per clip, every other request stalled by it.)"""
    import av

    if len(part.data) > max_s * 48000 * 2 * 2 + 4096:  # past any 48 kHz stereo 16-bit clip
        refuse(f"{where}.data", f"over {max_s:g} s of audio")
    field, limit = f"{where}.data", int(max_s * RATE)
    pieces: list[np.ndarray] = []
    heard = 0
    try:
        with av.open(io.BytesIO(part.data), metadata_errors="ignore") as container:
            if not container.streams.audio:
                refuse(field, f"the {part.media_type} data holds no audio stream")
            stream = container.streams.audio[0]
            rate = stream.sample_rate or 0
            if rate and rate < MIN_RATE:
                refuse(field, f"{rate} Hz is too low for speech (at least {MIN_RATE} Hz)")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
            for frame in chain(_frames(container, stream), [None]):  # None: flush
                for out in resampler.resample(frame):
                    piece = out.to_ndarray().reshape(-1)
                    pieces.append(piece)
                    heard += len(piece)
                if heard > limit:
                    refuse(field, f"the audio runs past {max_s:g} s: over the limit of {max_s:g} s")
    except (av.FFmpegError, ValueError, IndexError) as exc:
        refuse(field, f"the {part.media_type} data is not audio it can read ({exc})")
    if not pieces:
        return np.zeros(0, np.float32)
    return np.concatenate(pieces).astype(np.float32, copy=False)


def _frames(container: Any, stream: Any) -> Iterator[Any]:
    """The frames of ``stream`` it can decode, packet by packet: a damaged packet is
    skipped and the rest still read (a decoder's error would end ``decode()``)."""
    import av

    for packet in container.demux(stream):
        try:
            frames = stream.decode(packet)  # demux ends with an empty packet: the flush
        except av.error.InvalidDataError:
            continue
        for frame in frames:
            frame.pts = None  # timestamps are not checked: the samples are what count
            yield frame


def _resample(audio: np.ndarray, source: int) -> np.ndarray:
    if source == RATE or not len(audio):
        return audio.astype(np.float32)
    count = max(1, round(len(audio) * RATE / source))
    points = np.arange(count) * (source / RATE)
    return np.interp(points, np.arange(len(audio)), audio).astype(np.float32)


def _too_long(seconds: float, max_s: float) -> str:
    return f"{seconds:.1f} s of audio is over the limit of {max_s:g} s"
