"""A recogniser request's audio: the content parts of its last user message that
hold audio, read as float32 mono at Whisper's 16 kHz. Each bad clip is refused
naming its part (``inputs.messages[0].parts[1].data``): bytes that are not audio,
a rate too low to hold speech, a clip over the limit, silence."""

from __future__ import annotations

import io

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
    """Encoded audio (WAV, MP3, ...) through PyAV, as faster-whisper reads files."""
    import av
    from faster_whisper.audio import decode_audio

    if len(part.data) > max_s * 48000 * 2 * 2 + 4096:  # past any 48 kHz stereo 16-bit clip
        refuse(f"{where}.data", f"over {max_s:g} s of audio")
    try:
        with av.open(io.BytesIO(part.data), metadata_errors="ignore") as container:
            if not container.streams.audio:
                refuse(f"{where}.data", f"the {part.media_type} data holds no audio stream")
            rate = container.streams.audio[0].sample_rate or 0
        if rate and rate < MIN_RATE:
            refuse(f"{where}.data", f"{rate} Hz is too low for speech (at least {MIN_RATE} Hz)")
        return np.asarray(decode_audio(io.BytesIO(part.data), sampling_rate=RATE), np.float32)
    except (av.FFmpegError, ValueError, IndexError) as exc:
        refuse(f"{where}.data", f"the {part.media_type} data is not audio it can read ({exc})")


def _resample(audio: np.ndarray, source: int) -> np.ndarray:
    if source == RATE or not len(audio):
        return audio.astype(np.float32)
    count = max(1, round(len(audio) * RATE / source))
    points = np.arange(count) * (source / RATE)
    return np.interp(points, np.arange(len(audio)), audio).astype(np.float32)


def _too_long(seconds: float, max_s: float) -> str:
    return f"{seconds:.1f} s of audio is over the limit of {max_s:g} s"
