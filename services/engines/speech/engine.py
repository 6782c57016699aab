"""``SpeechEngine``: text to speech with hibari (CPU, onnxruntime).

A request gives ``inputs.text``, or token ids (an upstream thinker's, with the
``tokens`` transform) decoded with the tokenizer the stage's ``model`` names
(the thinker's own GGUF or tokenizer folder). Each complete sentence becomes one
segment with an "audio" tensor (float32 mono [samples], AudioFormat 24 kHz);
with ``runtime.streaming_input`` over a windowed edge each window speaks the
sentences it completes, and the end of the text is spoken when the input ends
(``HoldsInputBack``). Parameters: ``seed``, ``extra.voice``, ``extra.speed``,
``extra.return_wav`` (the whole audio as an audio/wav Blob at the end).
Voices are hibari names or files given by source (``VoiceSource``), which the
stage fetches in its download phase (``FetchesFiles``) and hands over before load.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from services.engines.base import (
    AudioFormat,
    Blob,
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    ProgressOutput,
    TensorOutput,
)
from services.engines.defaults import DefaultLayers, resolve
from services.engines.request_checks import (
    TEXT,
    TOKEN_IDS,
    check_seed,
    one_input,
    refuse,
    refuse_unknown_tensors,
)
from services.engines.speech import tokens
from services.engines.speech.config import MAX_SPEED, MIN_SPEED, SpeechArgs
from services.engines.speech.text import Decoder, Sentences, TokenText
from services.engines.speech.voice import Voice
from services.mesh import wav
from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)


@dataclass
class _Spoken:
    """What one request has said so far, kept from its first window to its end."""

    voice: str
    speed: float
    seed: int
    return_wav: bool
    text: TokenText | None
    sentences: Sentences
    chars: int = 0
    pcm: list[bytes] = field(default_factory=list)  # 16-bit, for the WAV at the end


@dataclass(frozen=True)
class SpeechPlan(EnginePlan):
    state: _Spoken
    sentences: tuple[str, ...]
    final: bool = False  # the request's input has ended: the WAV, if asked, goes last


class SpeechEngine:
    name: ClassVar[str] = "speech"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"seed", "extra.voice", "extra.speed", "extra.return_wav"}
    )
    output_tensors: ClassVar[tuple[str, ...]] = ("audio",)
    settings_model: ClassVar[type[SpeechArgs]] = SpeechArgs

    def __init__(self, settings: EngineSettings) -> None:
        self.args = SpeechArgs.of(settings)
        self._defaults = DefaultLayers(settings.defaults)
        self._voices: dict[str, Voice] = {}
        self._decoder: Decoder | None = None
        self._requests: OrderedDict[str, _Spoken] = OrderedDict()
        self._files: dict[str, Path] = {}
        self._cache_dir = settings.cache_dir

    @property
    def voices(self) -> list[str]:
        """The voices it offers, the first its default (the stage's Describe)."""
        return self.args.voice_names

    def sources(self) -> dict[str, str]:
        """The voices given by source, fetched by the stage in its download phase."""
        return {name: v.source for name, v in self.args.fetched_voices.items()}

    def use_files(self, paths: dict[str, Path]) -> None:
        self._files = dict(paths)

    def preparation(self, model_path: Path) -> str | None:
        """``capabilities.PreparesModel``: a GGUF's tokenizer, written once (tokens.py)."""
        return tokens.pending(model_path, self._cache_dir)

    def prepare(self, model_path: Path) -> None:
        tokens.write(model_path, self._cache_dir)

    def load(self, model_path: Path | None) -> ModelInfo:
        """The voices, and the tokenizer ``model_path`` names (a .gguf file or a folder)."""
        threads, fetched = self.args.threads, self.args.fetched_voices
        missing = set(fetched) - set(self._files)
        if missing:
            raise InitFailed(
                f"engine_args.voices: {sorted(missing)} not fetched (the stage fetches them "
                "before load: FetchesFiles)",
                field="engine_args.voices",
            )
        self._voices = {
            name: Voice.from_file(name, self._files[name], fetched[name].british, threads)
            if name in fetched
            else Voice.named(name, threads)
            for name in self.args.voice_names
        }
        if model_path is not None:
            self._decoder = tokens.decoder(model_path, self._cache_dir)
        what = f"hibari voices {', '.join(self._voices)}"
        decoded = f", tokens decoded with {model_path.name}" if model_path else ""
        return ModelInfo(model_bytes=0, description=what + decoded)

    def warmup(self) -> None:
        for voice in self._voices.values():
            voice.warm()

    @property
    def audio_format(self) -> AudioFormat:
        return AudioFormat(Voice.sample_rate, 1)

    def check(self, request: EngineRequest) -> SpeechPlan:
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            state = self._first(request)
        refuse_unknown_tensors(request, ())
        if not request.text.strip() if request.text else not request.token_ids:
            refuse(TEXT, "the text is empty: nothing to speak")
        field_ = one_input(request, (TEXT, TOKEN_IDS))
        limit = self.args.max_text_chars
        # A streamed answer is spoken window by window, so each window is bounded
        # and the whole is not: what is held is one unfinished sentence. Only a
        # WAV asked for at the end holds all the audio: its whole text counts.
        before = state.chars if state.return_wav else 0
        what = "the text (with extra.return_wav, all of it)" if state.return_wav else "one input"
        if field_ == TOKEN_IDS:
            if state.text is None:
                refuse(TOKEN_IDS, "this stage has no tokenizer (set its model) to read token ids")
            if before + len(request.token_ids) > limit:
                refuse(TOKEN_IDS, f"{what} is over the limit of {limit} characters")
            text = state.text.add(request.token_ids)
        else:
            text = request.text or ""
        if before + len(text) > limit:
            refuse(field_, f"{what} is over the limit of {limit} characters")
        if rid not in self._requests:  # every check passed: keep it
            self._keep(rid, state)
        state.chars += len(text)
        return SpeechPlan(request, state, tuple(state.sentences.add(text)))

    def input_ended(self, request_id: str) -> SpeechPlan | None:
        state = self._requests.get(request_id)
        if state is None:
            return None
        rest = state.text.rest() if state.text is not None else ""
        state.sentences.add(rest)
        return SpeechPlan(EngineRequest(request_id), state, tuple(state.sentences.rest()), True)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    async def generate(self, plan: SpeechPlan) -> AsyncGenerator[EngineEvent, None]:
        state, voice = plan.state, self._voices[plan.state.voice]
        fmt = self.audio_format
        for step, sentence in enumerate(plan.sentences, 1):
            audio = await asyncio.to_thread(voice.speak, sentence, state.speed, state.seed)
            if audio.size:
                if state.return_wav:
                    state.pcm.append(wav.pcm16(audio))
                yield TensorOutput({"audio": torch.from_numpy(audio)}, audio_format=fmt)
            # One segment per sentence: it is sent now, not with the next one.
            yield ProgressOutput(step=step, total_steps=len(plan.sentences))
        if plan.final and state.return_wav:
            data = wav.header(fmt.sample_rate, fmt.channels, sum(map(len, state.pcm)))
            blob = Blob("audio", wav.MEDIA_TYPE, data + b"".join(state.pcm))
            yield TensorOutput(blobs=(blob,))
        yield FinishOutput("done", completion_tokens=len(plan.sentences))

    def close(self) -> None:
        self._voices.clear()
        self._requests.clear()

    def _first(self, request: EngineRequest) -> _Spoken:
        """A new request's settings, each refused by name when bad."""
        params = resolve(request.params, self._defaults)
        check_seed(params.seed)
        extra: dict[str, Any] = dict(params.extra)
        voice = extra.get("voice", self.args.voice_names[0])
        if voice not in self._voices:
            refuse("params.extra.voice", f"unknown voice {voice!r} (offered: {list(self._voices)})")
        speed = extra.get("speed", self.args.speed)
        if isinstance(speed, bool) or not isinstance(speed, int | float):
            refuse("params.extra.speed", f"expected a number, got {speed!r}")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            refuse("params.extra.speed", f"must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        return_wav = extra.get("return_wav", False)
        if not isinstance(return_wav, bool):
            refuse("params.extra.return_wav", f"expected true or false, got {return_wav!r}")
        decoder = self._decoder
        return _Spoken(
            voice=voice,
            speed=float(speed),
            seed=params.seed or 0,
            return_wav=return_wav,
            text=TokenText(decoder) if decoder is not None else None,
            sentences=Sentences(self.args.max_sentence_chars),
        )

    def _keep(self, request_id: str, state: _Spoken) -> None:
        self._requests[request_id] = state
        while len(self._requests) > self.args.max_streams:
            dropped, _ = self._requests.popitem(last=False)
            logger.warning("speech: dropped the held text of request %s (max_streams)", dropped)
