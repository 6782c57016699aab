"""``QwenOmniThinker``: the thinker of a Qwen3-Omni checkpoint as a stage engine.

It answers a chat (text, images, audio: ``request.turns``) under the shared
scheduler (thinker_runner.py): requests are batched continuously, each token
streamed as it comes; with ``engine_args.handoff`` it sends the talker its part
(config.py) as it goes, so a windowed edge lets the talker start speaking while
the thinker is still writing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from services.engines.base import (
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    ModelInfo,
)
from services.engines.defaults import DefaultLayers, RequestDefaults, resolve
from services.engines.detokenizer import IncrementalDetokenizer
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni import loading, media
from services.engines.qwen_omni import processor as processors
from services.engines.qwen_omni.config import ThinkerArgs
from services.engines.qwen_omni.thinker_runner import ThinkerRequest, ThinkerRunner
from services.engines.request_checks import check_seed, refuse, refuse_unknown_tensors
from services.engines.sampling import Sampling
from services.engines.scheduler import EngineShell, Inbox, Limits, Scheduler

BUILT_IN = RequestDefaults(max_tokens=128, temperature=0.0, top_p=1.0, top_k=0)


@dataclass(frozen=True)
class ThinkerPlan(EnginePlan):
    inputs: dict[str, torch.Tensor]
    max_tokens: int
    sampling: Sampling
    seed: int | None


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
        self._shell: EngineShell[ThinkerRequest] = EngineShell(self.name, settings.device)

    def load(self, model_path: Path | None) -> ModelInfo:
        part = loading.load_engine_part(model_path, self.settings, self.name, "thinker")
        self._model, self._config = part.model, part.config
        self._processor = processors.load(part.folder)
        # Whole prompts (prefill_tokens None): a prompt with media runs its encoders
        # once, over all of it.
        limits = Limits(max_batch_size=self.settings.max_batch_size)
        self._shell.start(ThinkerRunner(self._model, self._config), limits, "thinker-steps")
        return part.info

    def warmup(self) -> None:
        return None

    @property
    def scheduler(self) -> Scheduler[ThinkerRequest]:
        return self._shell.scheduler

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
        sampling = Sampling(params.temperature or 0.0, params.top_p or 1.0, params.top_k or 0)
        return ThinkerPlan(request, inputs, params.max_tokens or 1, sampling, params.seed)

    async def generate(self, plan: ThinkerPlan) -> AsyncGenerator[EngineEvent, None]:
        inbox = Inbox()
        request = ThinkerRequest(
            request_id=plan.request.request_id,
            inputs={k: v.to(self.settings.device) for k, v in plan.inputs.items()},
            max_tokens=plan.max_tokens,
            sampling=plan.sampling,
            generator=self._shell.generator(plan.seed),
            eos=self._config.im_end_token_id,
            handoff=self.args.handoff,
            text=IncrementalDetokenizer(
                self._processor.tokenizer, plan.inputs["input_ids"][0].tolist()
            ),
            deliver=inbox.deliver,
            submitted=time.monotonic(),
        )
        with self._shell.running(request):
            async for event in inbox.events():
                yield event

    def close(self) -> None:
        self._shell.close()
        self._model = None
