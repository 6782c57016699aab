"""``QwenOmniThinker``: the thinker of a Qwen3-Omni checkpoint as a stage engine.

It answers a chat (text, images, audio: ``request.turns``) with the model's own
``generate``, streaming each token as it comes. At the end of the answer it
emits what the talker needs (config.py names them): the thinker's hidden
states of layer 0 and of the talker's accept layer for prompt and answer, the
prompt ids, the tts embeddings and the media grids, as one tokenless segment,
so a window -1 edge hands them over whole (by shm on one node).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from services.engines.base import (
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    ProgressOutput,
    TensorOutput,
    TokenOutput,
)
from services.engines.defaults import DefaultLayers, RequestDefaults, resolve
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni import loading, media
from services.engines.qwen_omni import processor as processors
from services.engines.qwen_omni.config import ThinkerArgs
from services.engines.qwen_omni.steps import Steps
from services.engines.request_checks import check_seed, refuse, refuse_unknown_tensors

BUILT_IN = RequestDefaults(max_tokens=128, temperature=0.0, top_p=1.0, top_k=0)


@dataclass(frozen=True)
class ThinkerPlan(EnginePlan):
    inputs: dict[str, torch.Tensor]
    generation: dict[str, Any]


class QwenOmniThinker:
    name: ClassVar[str] = "qwen_omni_thinker"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"max_tokens", "temperature", "top_p", "top_k", "seed", "return_hidden_states"}
    )
    output_tensors: ClassVar[tuple[str, ...]] = names.HANDOFF
    accepts: ClassVar[frozenset[str]] = frozenset({"text", "image", "audio"})
    settings_model: ClassVar[type[ThinkerArgs]] = ThinkerArgs

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.args = ThinkerArgs.of(settings)
        self._defaults = DefaultLayers(settings.defaults, built_in=BUILT_IN)
        self._model: Any = None
        self._config: Any = None
        self._processor: Any = None
        self._lock = asyncio.Lock()  # generate keeps per-call state (rope deltas) on the model

    def load(self, model_path: Path | None) -> ModelInfo:
        part = loading.load_engine_part(model_path, self.settings, self.name, "thinker")
        self._model, self._config = part.model, part.config
        self._processor = processors.load(part.folder)
        return part.info

    def warmup(self) -> None:
        return None

    def check(self, request: EngineRequest) -> ThinkerPlan:
        refuse_unknown_tensors(request, ())
        params = resolve(request.params, self._defaults)
        check_seed(params.seed)
        rate = self._processor.feature_extractor.sampling_rate
        chat = media.chat(request, rate)
        if chat.media_bytes > self.args.max_media_bytes:
            refuse("inputs", f"media over the limit of {self.args.max_media_bytes} bytes")
        text = self._processor.apply_chat_template(
            chat.messages, add_generation_prompt=True, tokenize=False
        )
        extra: dict[str, Any] = {}
        if chat.images:
            extra["images"] = chat.images
        if chat.audio:
            extra["audio"] = chat.audio
        inputs = dict(self._processor(text=[text], return_tensors="pt", **extra))
        prompt = inputs["input_ids"].shape[1]
        if prompt > self.settings.max_prompt_tokens:
            refuse(
                "inputs", f"the prompt is {prompt} tokens, over {self.settings.max_prompt_tokens}"
            )
        sample = bool(params.temperature)
        generation: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "do_sample": sample,
            "eos_token_id": self._config.im_end_token_id,
            "seed": params.seed,
        }
        if sample:
            generation.update(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k
            )
        return ThinkerPlan(request, inputs, generation)

    async def generate(self, plan: ThinkerPlan) -> AsyncGenerator[EngineEvent, None]:
        # Closed from outside, a nested generator would be closed later by the loop,
        # after the lock is let go: aclosing closes it (and stops its thread) first.
        async with self._lock, aclosing(self._answer(plan)) as events:
            async for event in events:
                yield event

    async def _answer(self, plan: ThinkerPlan) -> AsyncGenerator[EngineEvent, None]:
        inputs = {k: v.to(self.settings.device) for k, v in plan.inputs.items()}
        generation = dict(plan.generation)
        seed = generation.pop("seed")
        steps = Steps()
        streamer = _Streamer(steps)
        handoff = self.args.handoff

        def call() -> Any:
            from transformers import StoppingCriteriaList

            if seed is not None:
                torch.manual_seed(seed)
            stop = StoppingCriteriaList([steps.stop_requested])  # type: ignore[list-item]
            return self._model.generate(
                **inputs, **generation, streamer=streamer, stopping_criteria=stop,
                output_hidden_states=handoff, return_dict_in_generate=True,
            )  # fmt: skip

        text = _Text(self._processor.tokenizer)
        answer: list[int] = []
        async with aclosing(steps.run(call)) as produced:
            async for token in produced:
                answer.append(token)
                yield TokenOutput((token,), text.add(answer))
        if tail := text.rest(answer):  # an incomplete character at the very end
            yield TokenOutput((), tail)
        prompt_ids = inputs["input_ids"][0]
        if handoff:
            yield ProgressOutput(step=len(answer), total_steps=len(answer))  # the text goes first
            yield TensorOutput(self._handoff(steps.result, prompt_ids, inputs))
        reason = "stop" if answer and answer[-1] == generation["eos_token_id"] else "length"
        yield FinishOutput(reason, prompt_tokens=len(prompt_ids), completion_tokens=len(answer))

    def _handoff(
        self, result: Any, prompt_ids: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        accept = self._config.talker_config.accept_hidden_layer
        embed = torch.cat([h[0] for h in result.hidden_states], dim=1)[0]
        hidden = torch.cat([h[accept] for h in result.hidden_states], dim=1)[0]
        specials = torch.tensor(
            [self._config.tts_bos_token_id, self._config.tts_eos_token_id,
             self._config.tts_pad_token_id],
            device=prompt_ids.device,
        )  # fmt: skip
        with torch.no_grad():
            tts = self._model.get_input_embeddings()(specials)
        out = {
            names.HIDDEN: torch.stack((embed, hidden), dim=1).cpu(),
            names.PROMPT_IDS: prompt_ids.cpu(),
            names.TTS_EMBEDS: tts.cpu(),
        }
        if "image_grid_thw" in inputs:
            out[names.IMAGE_GRID] = inputs["image_grid_thw"].cpu()
        if "feature_attention_mask" in inputs:
            out[names.AUDIO_LENGTHS] = inputs["feature_attention_mask"].sum(dim=1).cpu()
        return out

    def close(self) -> None:
        self._model = None


class _Streamer:
    """A transformers streamer: skips the prompt, puts each new token id."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self._steps.put(int(token))

    def end(self) -> None:
        return None


class _Text:
    """The text new tokens add, held back while a character's bytes are incomplete."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._sent = 0

    def add(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self._sent = text[self._sent :], len(text)
        return new

    def rest(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True)
        return text[self._sent :]
