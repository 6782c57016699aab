"""The monolithic reference: ``Qwen3OmniMoeForConditionalGeneration.generate(...,
return_audio=True)`` on the same checkpoint, prompt and settings the mesh runs,
with the talker's codes kept (a forward hook, as the talker engine reads them).

The prompts: text only, an image (a seeded random PNG) and an audio clip (a
16 kHz sine as a 16-bit WAV), each with a line of text after it.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engines.base import ChatTurn, EngineRequest, MediaPart, SamplingParams
from services.engines.qwen_omni import processor as processors

QUESTION = "Say something about this."
THINKER_TOKENS = 12
TALKER_TOKENS = 40
SPEAKER = "ethan"


def png() -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def wav_clip() -> bytes:
    samples = 0.3 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 220)
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16000)
        clip.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def media(kind: str) -> MediaPart | None:
    if kind == "image":
        return MediaPart("image", "image/png", png())
    if kind == "audio":
        return MediaPart("audio", "audio/wav", wav_clip())
    return None


def request(kind: str, request_id: str = "r1", **params: Any) -> EngineRequest:
    """The prompt of ``kind`` ("text", "image", "audio") as the stage hands it to an engine."""
    part = media(kind)
    parts = (part, QUESTION) if part is not None else ()
    turns = (ChatTurn("user", QUESTION, parts),) if parts else ()
    return EngineRequest(
        request_id,
        messages=(("user", QUESTION),),
        turns=turns,
        params=SamplingParams(**params),
    )


@dataclass(frozen=True)
class Reference:
    answer_ids: list[int]
    codes: torch.Tensor  # [T, num_code_groups]
    audio: torch.Tensor  # [samples] float32


def monolithic(folder: Path, kind: str) -> Reference:
    """One greedy ``generate(return_audio=True)`` of the whole model on prompt ``kind``."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from services.engines.qwen_omni import media as media_mod

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    ).eval()
    processor = processors.load(folder)
    chat = media_mod.chat(request(kind), processor.feature_extractor.sampling_rate)
    text = processor.apply_chat_template(chat.messages, add_generation_prompt=True, tokenize=False)
    extra: dict[str, Any] = {}
    if chat.images:
        extra["images"] = chat.images
    if chat.audio:
        extra["audio"] = chat.audio
    inputs = processor(text=[text], return_tensors="pt", **extra)
    codes: list[torch.Tensor] = []

    def keep(_: Any, __: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("residual_codes") is not None:
            codes.append(kwargs["residual_codes"][0].clone())

    hook = model.talker.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        sequences, audio = model.generate(
            **inputs,
            return_audio=True,
            speaker=SPEAKER,
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_eos_token_id=model.config.im_end_token_id,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=TALKER_TOKENS,
        )
    finally:
        hook.remove()
    prompt = inputs["input_ids"].shape[1]
    return Reference(sequences[0, prompt:].tolist(), torch.stack(codes), audio.reshape(-1))
