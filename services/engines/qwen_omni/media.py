"""A chat's content parts as the Qwen3-Omni processor takes them.

Each turn becomes a chat-template message whose content lists its parts in
order ({"type": "image"} / {"type": "audio"} / {"type": "text"}); the images
(decoded with Pillow, RGB) and the audio clips (float32 mono at the feature
extractor's rate) go beside it in the order they appear. Audio comes as a WAV
(16-bit PCM, any channel count, averaged to mono) or as PCM with its rate; a
clip at another rate is resampled linearly (the model listens at 16 kHz). A part
that cannot be decoded is refused naming it.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.engines.base import ChatTurn, EngineRequest, MediaPart
from services.engines.request_checks import refuse


@dataclass
class Chat:
    """What the processor gets: template messages, images and audio, in order."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    media_bytes: int = 0


def chat(request: EngineRequest, sample_rate: int) -> Chat:
    """``request``'s prompt: its turns (with media), its messages, or its text as one user turn."""
    out = Chat()
    if request.turns:
        for t, turn in enumerate(request.turns):
            out.messages.append({"role": turn.role, "content": _content(turn, t, out, sample_rate)})
    elif request.messages:
        out.messages = [{"role": role, "content": text} for role, text in request.messages]
    elif request.text:
        out.messages = [{"role": "user", "content": request.text}]
    else:
        refuse("inputs", "expected text, messages or content parts to answer")
    return out


def _content(turn: ChatTurn, t: int, out: Chat, sample_rate: int) -> list[dict[str, Any]] | str:
    if not turn.parts:
        return turn.content
    content: list[dict[str, Any]] = []
    for p, part in enumerate(turn.parts):
        where = f"inputs.messages[{t}].parts[{p}]"
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        elif part.kind == "image":
            out.images.append(_image(part, where))
            content.append({"type": "image"})
        elif part.kind == "audio":
            out.audio.append(_audio(part, where, sample_rate))
            content.append({"type": "audio"})
        else:
            refuse(where, f"this engine takes text, image and audio, not {part.kind}")
        if not isinstance(part, str):
            out.media_bytes += len(part.data) + (part.pcm.nbytes if part.pcm is not None else 0)
    return content


def _image(part: MediaPart, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(part.data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        refuse(f"{where}.data", f"the {part.media_type} image cannot be decoded ({exc})")


def _audio(part: MediaPart, where: str, rate: int) -> np.ndarray:
    if part.media_type == "audio/pcm":
        if part.pcm is None or part.pcm.dim() != 1 or part.sample_rate < 1:
            refuse(f"{where}.pcm", "expected float32 mono samples [n] with a sample rate")
        return _resample(part.pcm.float().numpy(), part.sample_rate, rate)
    try:
        with wave.open(io.BytesIO(part.data)) as clip:
            if clip.getsampwidth() != 2:
                refuse(f"{where}.data", "a WAV of 16-bit PCM is expected")
            frames = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2")
            channels, clip_rate = clip.getnchannels(), clip.getframerate()
    except (wave.Error, EOFError) as exc:
        refuse(f"{where}.data", f"the {part.media_type} clip is not a WAV it can read ({exc})")
    samples = frames.reshape(-1, channels).mean(axis=1) / 32768.0
    return _resample(samples.astype(np.float32), clip_rate, rate)


def _resample(samples: np.ndarray, source: int, target: int) -> np.ndarray:
    if source == target or not len(samples):
        return samples.astype(np.float32)
    count = max(1, round(len(samples) * target / source))
    points = np.arange(count) * (source / target)
    return np.interp(points, np.arange(len(samples)), samples).astype(np.float32)
