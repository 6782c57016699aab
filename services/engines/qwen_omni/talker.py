"""``QwenOmniTalker``: the talker of a Qwen3-Omni checkpoint (with its code
predictor) as a stage engine.

Its input is the thinker's hand-off (config.py) over a window -1 edge: the
answer's token ids and the thinker's tensors. It builds the talker's prompt as
the monolithic ``generate`` does (handoff.py) and runs ``talker.generate``; the
codes of each step ([1, num_code_groups] int64: the talker's token and the code
predictor's residual codes) are emitted as they are made, one segment per step,
so the edge to code2wav can be windowed.

Not streamed on the thinker's windows: the talker's prompt needs the answer's
first token and whether the answer has ended (the tts_eos marker), and
transformers' ``generate`` takes the trailing text as one tensor at the start;
feeding it row by row as the thinker writes would need a talker loop of our own.
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
)
from services.engines.defaults import DefaultLayers, RequestDefaults, resolve
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni import loading
from services.engines.qwen_omni.config import TalkerArgs
from services.engines.qwen_omni.handoff import Handoff, talker_inputs
from services.engines.qwen_omni.steps import Steps
from services.engines.request_checks import (
    TOKEN_IDS,
    check_seed,
    refuse,
    refuse_unknown_tensors,
    tensor_field,
)
from services.mesh.errors import InitFailed


@dataclass(frozen=True)
class TalkerPlan(EnginePlan):
    handoff: Handoff
    speaker_id: int
    generation: dict[str, Any]


class QwenOmniTalker:
    name: ClassVar[str] = "qwen_omni_talker"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"max_tokens", "temperature", "top_p", "top_k", "seed", "extra.speaker",
         "extra.repetition_penalty"}
    )  # fmt: skip
    output_tensors: ClassVar[tuple[str, ...]] = (names.CODES,)
    settings_model: ClassVar[type[TalkerArgs]] = TalkerArgs

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.args = TalkerArgs.of(settings)
        built_in = RequestDefaults(
            max_tokens=self.args.max_new_tokens, temperature=self.args.temperature,
            top_p=self.args.top_p, top_k=self.args.top_k,
        )  # fmt: skip
        self._defaults = DefaultLayers(settings.defaults, built_in=built_in)
        self._model: Any = None
        self._config: Any = None
        self._lock = asyncio.Lock()  # generate keeps per-call state (rope deltas) on the model

    def load(self, model_path: Path | None) -> ModelInfo:
        part = loading.load_engine_part(model_path, self.settings, self.name, "talker")
        self._model, self._config = part.model, part.config
        speakers = self._config.talker_config.speaker_id
        if self.args.speaker not in speakers:
            raise InitFailed(
                f"engine_args.speaker: unknown speaker {self.args.speaker!r} "
                f"(offered: {sorted(speakers)})",
                field="engine_args.speaker",
            )
        return part.info

    def warmup(self) -> None:
        return None

    def check(self, request: EngineRequest) -> TalkerPlan:
        refuse_unknown_tensors(request, names.HANDOFF)
        params = resolve(request.params, self._defaults)
        check_seed(params.seed)
        handoff = self._handoff(request)
        extra = dict(params.extra)
        speakers = self._config.talker_config.speaker_id
        speaker = str(extra.get("speaker", self.args.speaker)).lower()
        if speaker not in speakers:
            refuse(
                "params.extra.speaker", f"unknown speaker {speaker!r} (offered: {list(speakers)})"
            )
        penalty = extra.get("repetition_penalty", self.args.repetition_penalty)
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or penalty <= 0:
            refuse("params.extra.repetition_penalty", f"expected a number > 0, got {penalty!r}")
        talker = self._config.talker_config
        vocab = talker.text_config.vocab_size
        sample = bool(params.temperature)
        generation: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "do_sample": sample,
            "eos_token_id": talker.codec_eos_token_id,
            "repetition_penalty": float(penalty),
            # As the monolithic model: the top 1024 ids are special, but the end.
            "suppress_tokens": [
                i for i in range(vocab - 1024, vocab) if i != talker.codec_eos_token_id
            ],
            "seed": params.seed,
        }
        if sample:
            generation.update(
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
            )
        return TalkerPlan(request, handoff, speakers[speaker], generation)

    def _handoff(self, request: EngineRequest) -> Handoff:
        tensors = request.tensors
        for name in (names.HIDDEN, names.PROMPT_IDS, names.TTS_EMBEDS):
            if name not in tensors:
                refuse(tensor_field(name), "missing: the thinker's hand-off (a window -1 edge "
                       "from a qwen_omni_thinker with engine_args.handoff)")  # fmt: skip
        if not request.token_ids:
            refuse(TOKEN_IDS, "the thinker's answer ids are missing")
        prompt = tensors[names.PROMPT_IDS].long().reshape(-1)
        answer = torch.tensor(request.token_ids, dtype=torch.long)
        hidden = tensors[names.HIDDEN]
        size = self._config.talker_config.thinker_hidden_size
        rows = len(prompt) + len(answer) - 1
        if tuple(hidden.shape) != (rows, 2, size):
            why = "prompt + answer - 1 rows; layer 0 and the accept layer"
            got = list(hidden.shape)
            refuse(tensor_field(names.HIDDEN), f"expected [{rows}, 2, {size}] ({why}), got {got}")
        tts = tensors[names.TTS_EMBEDS]
        if tuple(tts.shape) != (3, size):
            refuse(tensor_field(names.TTS_EMBEDS), f"expected [3, {size}], got {list(tts.shape)}")
        grid = tensors.get(names.IMAGE_GRID)
        lengths = tensors.get(names.AUDIO_LENGTHS)
        return Handoff(
            prompt_ids=prompt,
            answer_ids=answer,
            embed=hidden[:, 0],
            hidden=hidden[:, 1],
            tts=tts,
            image_grid_thw=grid.long() if grid is not None else None,
            audio_feature_lengths=lengths.long() if lengths is not None else None,
        )

    async def generate(self, plan: TalkerPlan) -> AsyncGenerator[EngineEvent, None]:
        # Closed from outside, a nested generator would be closed later by the loop,
        # after the lock is let go: aclosing closes it (and stops its thread) first.
        async with self._lock, aclosing(self._speak(plan)) as events:
            async for event in events:
                yield event

    async def _speak(self, plan: TalkerPlan) -> AsyncGenerator[EngineEvent, None]:
        generation = dict(plan.generation)
        seed = generation.pop("seed")
        eos = self.args.thinker_eos_token_id
        if eos is None:
            eos = self._config.im_end_token_id
        steps = Steps()

        def codes_of_step(_: Any, __: Any, kwargs: dict[str, Any]) -> None:
            # Each step's forward gets the previous token's codes (None at prefill).
            codes = kwargs.get("residual_codes")
            if codes is not None:
                steps.put(codes.detach().to("cpu", copy=True))

        def call() -> Any:
            from transformers import StoppingCriteriaList

            model = self._model
            with torch.no_grad():
                handoff = plan.handoff.to(self.settings.device)
                inputs = talker_inputs(model, self._config, handoff, plan.speaker_id, eos)
                if seed is not None:
                    torch.manual_seed(seed)
                hook = model.register_forward_pre_hook(codes_of_step, with_kwargs=True)
                try:
                    stop = StoppingCriteriaList([steps.stop_requested])  # type: ignore[list-item]
                    return model.generate(
                        **inputs, **generation, stopping_criteria=stop,
                        output_hidden_states=True, return_dict_in_generate=True,
                    )  # fmt: skip
                finally:
                    hook.remove()

        count = 0
        async with aclosing(steps.run(call)) as produced:
            async for codes in produced:
                count += 1
                yield TensorOutput({names.CODES: codes})
                yield ProgressOutput(step=count, total_steps=generation["max_new_tokens"])
        yield FinishOutput(
            "done", prompt_tokens=len(plan.handoff.prompt_ids), completion_tokens=count
        )

    def close(self) -> None:
        self._model = None
