"""The transformers engine: any causal LM that transformers can load, on CPU or GPU.

Requests are batched continuously by the shared scheduler (services/engines/
scheduler): every running request shares each forward, new ones join between steps,
and a request whose consumer stops iterating ``generate`` (aclose, task cancel)
leaves at the next step. The model runner (runners/) is chosen once at load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from services.engines import text_intake
from services.engines.base import (
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    SamplingParams,
)
from services.engines.defaults import TEXT_BUILT_IN, DefaultLayers
from services.engines.prompt_size import longest_token_chars
from services.engines.scheduler import Delivery, EngineShell, Inbox, Limits, Scheduler
from services.engines.text_intake import TextPlan
from services.engines.transformers import intake
from services.engines.transformers.config import TransformersArgs
from services.engines.transformers.loading import ConvertsGguf, load_model
from services.engines.transformers.runners import KvBudget, TextRunner, runner_for, runner_name
from services.engines.transformers.text_request import TextRequest
from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)

_WARMUP_TIMEOUT_S = 600.0


class TransformersEngine(ConvertsGguf):
    name: ClassVar[str] = "transformers"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "return_hidden_states"}
    )
    output_tensors: ClassVar[tuple[str, ...]] = ("hidden_states",)
    settings_model: ClassVar[type[TransformersArgs]] = TransformersArgs

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._args = TransformersArgs.of(settings)
        self._dtype = self._args.torch_dtype(settings)
        self._defaults = DefaultLayers(settings.defaults, self._args.defaults, TEXT_BUILT_IN)
        self._model: PreTrainedModel | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._limits: intake.Limits | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._shell: EngineShell[TextRequest] = EngineShell("TransformersEngine", settings.device)
        self._budget: KvBudget | None = None
        self._active: dict[str, TextRequest] = {}

    # -- lifecycle -------------------------------------------------------------

    def load(self, model_path: Path | None) -> ModelInfo:
        if model_path is None:
            raise InitFailed(
                "model: the transformers engine needs a model (its config and tokenizer), "
                "even with load_format: dummy",
                field="model",
            )
        loaded = load_model(model_path, self._settings, self._args, self._dtype)
        model, tokenizer = loaded.model, loaded.tokenizer
        config = model.config.get_text_config(decoder=True)
        embeddings = model.get_input_embeddings()  # may have more rows than the tokenizer
        self._limits = intake.Limits(
            max_prompt_tokens=self._settings.max_prompt_tokens,
            max_positions=config.max_position_embeddings,
            vocab_size=int(getattr(embeddings, "num_embeddings", config.vocab_size)),
            hidden_size=config.hidden_size,
            token_chars=longest_token_chars(tokenizer),
        )
        self._eos_ids = _eos_ids(model, tokenizer)
        self._model, self._tokenizer = model, tokenizer
        runner = self._start()
        compute = f"{runner_name(runner)} runner, {loaded.weights}"
        logger.info("transformers engine: %s", compute)
        return replace(loaded.info, compute=compute)

    def plan_kv_cache(self, pages: int, page_size: int) -> None:
        assert self._limits is not None, "plan_kv_cache before load"
        self._budget = self.runner.budget = KvBudget(pages, page_size)
        self._limits = replace(self._limits, kv_tokens=pages * page_size, page_size=page_size)
        logger.info(
            "transformers engine: %d KV pages of %d positions (a padded cache), up to %d "
            "requests a step",
            pages,
            page_size,
            self._settings.max_batch_size,
        )

    def warmup(self) -> None:
        request = EngineRequest(
            "warmup", token_ids=(0, 1), params=SamplingParams(max_tokens=2, temperature=0.0)
        )
        done = threading.Event()
        failures: list[BaseException] = []

        def deliver(delivery: Delivery) -> None:
            if isinstance(delivery, BaseException):
                failures.append(delivery)
                done.set()
            elif any(isinstance(event, FinishOutput) for event in delivery):
                done.set()

        self._running().submit(self._text_request(request, self._plan(request), deliver))
        if not done.wait(_WARMUP_TIMEOUT_S) or failures:
            raise InitFailed("the transformers warm-up step failed (see the stage log)") from (
                failures[0] if failures else None
            )

    def close(self) -> None:
        self._shell.close()

    @property
    def model(self) -> PreTrainedModel:
        return self._loaded()[0]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._loaded()[1]

    @property
    def scheduler(self) -> Scheduler[TextRequest]:
        return self._running()

    @property
    def runner(self) -> TextRunner:
        return self._running().runner  # type: ignore[return-value]

    @property
    def active_requests(self) -> frozenset[str]:
        """Ids of the requests being generated now (for metrics and tests)."""
        return frozenset(self._active)

    # -- requests --------------------------------------------------------------

    def arriving(self) -> None:
        """A request is on its way (capabilities.HearsArrivals): the scheduler hears of
        it before its prompt is tokenized, so that requests checked together all
        count when it gathers the first arrival."""
        self._running().expect()

    def check(self, request: EngineRequest) -> TextPlan[intake.Plan]:
        # The stage calls this in a thread, several at once: safe, as with no
        # truncation or padding asked for, encoding never reconfigures the Rust
        # tokenizer (the one thing that raises "Already borrowed" across threads).
        return TextPlan(request, self._plan(request))

    async def generate(self, plan: TextPlan[intake.Plan]) -> AsyncGenerator[EngineEvent, None]:
        request, resolved = plan.request, plan.resolved
        rid = request.request_id
        inbox = Inbox()
        text_request = self._text_request(request, resolved, inbox.deliver)
        if rid in self._active:
            logger.warning("request %s: id already running", rid)
        self._active[rid] = text_request
        logger.debug("request %s: %d prompt tokens", rid, resolved.prompt_tokens)
        try:
            with self._shell.running(text_request):
                async for event in inbox.events():
                    if isinstance(event, FinishOutput):
                        logger.debug(
                            "request %s: finished (%s) after %d tokens",
                            rid,
                            event.reason,
                            event.completion_tokens,
                        )
                    yield event
        finally:
            if self._active.get(rid) is text_request:
                del self._active[rid]

    # -- helpers ---------------------------------------------------------------

    def _plan(self, request: EngineRequest) -> intake.Plan:
        tokenizer = self._loaded()[1]
        assert self._limits is not None
        return intake.plan(text_intake.check(request, tokenizer, self._limits, self._defaults))

    def _text_request(
        self, request: EngineRequest, plan: intake.Plan, deliver: Callable[[Delivery], None]
    ) -> TextRequest:
        return TextRequest(
            request_id=request.request_id,
            plan=plan,
            tokenizer=self._loaded()[1],
            generator=self._shell.generator(plan.seed),
            deliver=deliver,
            submitted=time.monotonic(),
            eos_ids=self._eos_ids,
        )

    def _start(self) -> TextRunner:
        """The runner for the loaded model and the scheduler over it."""
        model = self._loaded()[0]
        runner = runner_for(model, self._budget, self._args.runner)
        limits = Limits(
            max_batch_size=self._settings.max_batch_size,
            prefill_tokens=self._args.prefill_tokens,
            gather_s=self._args.gather_ms / 1e3,
        )
        self._shell.start(runner, limits, "transformers-steps")
        return runner

    def _running(self) -> Scheduler[TextRequest]:
        return self._shell.scheduler

    def _loaded(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if self._model is None or self._tokenizer is None:
            raise RuntimeError("TransformersEngine: call load() first")
        return self._model, self._tokenizer


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
