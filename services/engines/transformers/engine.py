"""The transformers engine: any causal LM that transformers can load, on CPU or GPU.

Each request runs its own decode loop over a private ``DynamicCache``. Every
forward step is one job on a single model thread, so concurrent requests take
turns step by step and a cancelled request stops at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from services.engines.base import (
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    TokenOutput,
)
from services.engines.transformers import intake
from services.engines.transformers.config import TransformersArgs
from services.engines.transformers.loading import (
    conversion_pending,
    converted_folder,
    load_model,
)
from services.engines.transformers.sampling import sample
from services.engines.transformers.text import IncrementalDetokenizer, StopStrings
from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)


@dataclass
class _Running:
    """What ``abort`` needs to reach a request that is being generated."""

    request_id: str
    aborted: bool = False


class TransformersEngine:
    name: ClassVar[str] = "transformers"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "return_hidden_states"}
    )
    output_tensors: ClassVar[tuple[str, ...]] = ("hidden_states",)

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._args = TransformersArgs.from_settings(settings)
        # One thread owns the model: steps of different requests queue up in
        # arrival order, which is what interleaves them fairly.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers-step")
        self._model: PreTrainedModel | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._limits: intake.Limits | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._running: dict[str, _Running] = {}

    # -- lifecycle -------------------------------------------------------------

    def preparation(self, model_path: Path) -> str | None:
        return conversion_pending(model_path, self._settings.cache_dir)

    def prepare(self, model_path: Path) -> None:
        converted_folder(model_path, self._settings.cache_dir)

    def load(self, model_path: Path | None) -> ModelInfo:
        if model_path is None:
            raise InitFailed(
                "model: the transformers engine needs a model (its config and tokenizer), "
                "even with load_format: dummy",
                field="model",
            )
        loaded = load_model(model_path, self._settings, self._args)
        model, tokenizer = loaded.model, loaded.tokenizer
        config = model.config.get_text_config(decoder=True)
        embeddings = model.get_input_embeddings()  # may have more rows than the tokenizer
        self._limits = intake.Limits(
            max_prompt_tokens=self._settings.max_prompt_tokens,
            max_positions=config.max_position_embeddings,
            vocab_size=int(getattr(embeddings, "num_embeddings", config.vocab_size)),
            hidden_size=config.hidden_size,
        )
        self._eos_ids = _eos_ids(model, tokenizer)
        self._model, self._tokenizer = model, tokenizer
        return loaded.info

    def warmup(self) -> None:
        model = self._loaded()[0]
        ids = torch.tensor([[0, 1]], device=model.device)

        def step() -> None:
            with torch.inference_mode():
                model(input_ids=ids, past_key_values=DynamicCache(config=model.config))

        self._executor.submit(step).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def active_requests(self) -> frozenset[str]:
        """Ids of the requests being generated now (for metrics and tests)."""
        return frozenset(self._running)

    # -- requests --------------------------------------------------------------

    def check(self, request: EngineRequest) -> None:
        self._plan(request)

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineEvent, None]:
        plan = self._plan(request)
        model, tokenizer = self._loaded()
        rid = request.request_id
        if rid in self._running:
            logger.warning("request %s: id already running; abort reaches the newest", rid)
        running = self._running[rid] = _Running(rid)
        loop = asyncio.get_running_loop()
        state = _Decode(model, plan, self._generator(plan.seed))
        detok = IncrementalDetokenizer(tokenizer, plan.token_ids)
        stops = StopStrings(plan.stop)
        completion = 0
        reason = ""
        logger.debug("request %s: %d prompt tokens", rid, plan.prompt_tokens)
        try:
            while not reason:
                if running.aborted:
                    reason = "abort"
                    break
                token, hidden = await loop.run_in_executor(self._executor, state.step)
                completion += 1
                text = stops.add(detok.add(token))
                if stops.stopped:
                    reason = "stop"
                else:
                    reason = _end_reason(token in self._eos_ids, completion >= plan.max_tokens)
                    if reason:
                        # The text ends here: release what was held back for a
                        # character or a stop string that can no longer complete.
                        text += stops.add(detok.flush())
                        reason = "stop" if stops.stopped else reason
                        text += stops.flush()
                yield TokenOutput(token_ids=(token,), text=text, hidden_states=hidden)
            yield FinishOutput(
                reason, prompt_tokens=plan.prompt_tokens, completion_tokens=completion
            )
            logger.debug("request %s: finished (%s) after %d tokens", rid, reason, completion)
        finally:
            # Runs on normal end, aclose() and task cancellation alike; the cache
            # goes with `state`.
            if self._running.get(rid) is running:
                del self._running[rid]

    # -- helpers ---------------------------------------------------------------

    def _plan(self, request: EngineRequest) -> intake.Plan:
        tokenizer = self._loaded()[1]
        assert self._limits is not None
        return intake.plan(request, tokenizer, self._limits, self._args.defaults)

    def _loaded(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if self._model is None or self._tokenizer is None:
            raise RuntimeError("TransformersEngine: call load() first")
        return self._model, self._tokenizer

    def _generator(self, seed: int | None) -> torch.Generator:
        generator = torch.Generator(device=self._settings.device)
        if seed is None:
            generator.seed()  # fresh entropy per request
        else:
            generator.manual_seed(seed)
        return generator


class _Decode:
    """One request's model state; ``step`` runs on the model thread and returns
    the next token and, when asked for, the hidden state that produced it."""

    def __init__(self, model: PreTrainedModel, plan: intake.Plan, generator: torch.Generator):
        self._model = model
        self._plan = plan
        self._generator = generator
        self._cache = DynamicCache(config=model.config)
        self._last: int | None = None  # None until the prompt has been run

    def step(self) -> tuple[int, torch.Tensor | None]:
        model, plan = self._model, self._plan
        inputs: dict[str, Any]
        if self._last is not None:
            inputs = {"input_ids": torch.tensor([[self._last]], device=model.device)}
        elif plan.embeds is not None:
            embeds = plan.embeds.to(device=model.device, dtype=model.dtype)
            inputs = {"inputs_embeds": embeds.unsqueeze(0)}
        else:
            inputs = {"input_ids": torch.tensor([plan.token_ids], device=model.device)}
        with torch.inference_mode():
            out = model(
                **inputs,
                past_key_values=self._cache,
                use_cache=True,
                output_hidden_states=plan.return_hidden_states,
                logits_to_keep=1,  # the prompt's other positions need no logits
            )
            self._last = sample(out.logits[0, -1].float(), plan.sampling, self._generator)
            hidden = None
            if plan.return_hidden_states:
                # A copy, so the event does not pin the whole prompt's activations.
                hidden = out.hidden_states[-1][:, -1].to("cpu", torch.float32, copy=True)
        return self._last, hidden


def _end_reason(eos: bool, full: bool) -> str:
    return "eos" if eos else "length" if full else ""


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    configured = model.generation_config.eos_token_id if model.generation_config else None
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
