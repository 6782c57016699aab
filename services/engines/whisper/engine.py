"""``WhisperEngine``: speech to text (faster-whisper, CTranslate2).

A request's audio is the audio content parts of its last user message (a chat
completion's ``input_audio``, a realtime turn, a file to transcribe), read by
audio.py; each becomes text, Whisper's segments streamed out as they are
decoded (``TokenOutput``: the segment's token ids and text). A request without
audio passes its text through unchanged, so a pipeline that runs every stage
for a typed prompt loses nothing here. Parameters: ``extra.language`` and
``extra.prompt`` (Whisper's initial prompt: names and spellings to expect).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from services.engines.base import (
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    TokenOutput,
)
from services.engines.defaults import DefaultLayers, resolve
from services.engines.request_checks import MESSAGES, TEXT, refuse, refuse_unknown_tensors
from services.engines.whisper import fitted
from services.engines.whisper.audio import samples, user_audio
from services.engines.whisper.config import WhisperArgs
from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WhisperPlan(EnginePlan):
    clips: tuple[np.ndarray, ...]  # 16 kHz float32, in message order
    text: str  # passed through when there is no audio
    language: str | None
    prompt: str | None


class WhisperEngine:
    name: ClassVar[str] = "whisper"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"seed", "max_tokens", "extra.language", "extra.prompt"}
    )
    output_tensors: ClassVar[tuple[str, ...]] = ()
    accepts: ClassVar[frozenset[str]] = frozenset({"text", "audio"})
    settings_model: ClassVar[type[WhisperArgs]] = WhisperArgs

    def __init__(self, settings: EngineSettings) -> None:
        self.args = WhisperArgs.of(settings)
        self._device = settings.device
        self._defaults = DefaultLayers(settings.defaults)
        self._model: Any = None

    def load(self, model_path: Path | None) -> ModelInfo:
        """A CTranslate2 Whisper folder (model.bin, tokenizer.json, config.json)."""
        from faster_whisper import WhisperModel

        if model_path is None or not (model_path / "model.bin").is_file():
            raise InitFailed(
                f"model: {model_path} is not a CTranslate2 Whisper folder (no model.bin)",
                field="model",
            )
        device = "cuda" if self._device.startswith("cuda") else "cpu"
        index = int(self._device.partition(":")[2] or 0) if device == "cuda" else 0
        self._model = WhisperModel(
            str(model_path),
            device=device,
            device_index=index,
            compute_type=self.args.compute_type,
            cpu_threads=self.args.threads,
            num_workers=self.args.workers,
        )
        size = (model_path / "model.bin").stat().st_size
        at_once = self.args.workers
        what = f"whisper {model_path.name} ({self.args.compute_type}, {device}, {at_once} at once)"
        return ModelInfo(model_bytes=size, description=what)

    def warmup(self) -> None:
        one_second = np.zeros(16000, dtype=np.float32)
        one_second[::160] = 0.1  # not silence: the decoder runs once
        list(self._segments(one_second, self.args.language, None))

    def check(self, request: EngineRequest) -> WhisperPlan:
        refuse_unknown_tensors(request, ())
        params = resolve(request.params, self._defaults)
        extra = dict(params.extra)
        language = extra.get("language", self.args.language)
        if language is not None and not (isinstance(language, str) and 2 <= len(language) <= 3):
            refuse("params.extra.language", f"expected a language code like 'en', got {language!r}")
        if language is not None and not self._multilingual and language != "en":
            refuse("params.extra.language", f"this model knows English only, not {language!r}")
        prompt = extra.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            refuse("params.extra.prompt", f"expected text, got {prompt!r}")
        args = self.args
        clips = tuple(
            samples(part, where, args.max_audio_s, args.min_peak)
            for where, part in user_audio(request)
        )
        text = ""
        if not clips:
            text = request.text or (request.messages[-1][1] if request.messages else "")
            if not text.strip():
                refuse(MESSAGES if request.messages else TEXT, "expected audio to transcribe")
        return WhisperPlan(request, clips, text, language, prompt)

    async def generate(self, plan: WhisperPlan) -> AsyncGenerator[EngineEvent, None]:
        if not plan.clips:
            yield TokenOutput(token_ids=(), text=plan.text)
            yield FinishOutput("done")
            return
        tokens, heard = 0, 0
        for clip in plan.clips:
            segments = self._segments(clip, plan.language, plan.prompt)
            while (segment := await asyncio.to_thread(next, segments, None)) is not None:
                text = segment.text if heard else segment.text.lstrip()
                heard += len(text)
                tokens += len(segment.tokens)
                yield TokenOutput(token_ids=tuple(segment.tokens), text=text)
        seconds = sum(len(c) for c in plan.clips) // 16000
        logger.debug(
            "request %s: %d s of audio, %d tokens", plan.request.request_id, seconds, tokens
        )
        yield FinishOutput("done", prompt_tokens=seconds, completion_tokens=tokens)

    def close(self) -> None:
        self._model = None

    @property
    def _multilingual(self) -> bool:
        return bool(self._model is None or self._model.model.is_multilingual)

    def _segments(
        self, clip: np.ndarray, language: str | None, prompt: str | None
    ) -> Iterator[Any]:
        """Whisper's segments of ``clip``, decoded one by one as they are read (in
        the caller's thread): a short clip in a window fitted to it, where its
        answer looks right (fitted.py), else in Whisper's 30 s windows."""
        if self.args.fitted_window and fitted.fits(clip):
            heard = fitted.hear(self._model, clip, language, prompt, self.args.beam_size)
            if heard is not None:
                yield heard
                return
        segments, _ = self._model.transcribe(
            clip,
            language=language,
            beam_size=self.args.beam_size,
            initial_prompt=prompt,
            condition_on_previous_text=False,
            vad_filter=False,
        )
        yield from segments
