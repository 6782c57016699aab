"""``DiffusersEngine``: any local ``DiffusionPipeline``; concurrent requests that
fit one call denoise as one batch (batch.py).

The pipeline runs on one thread the engine owns, requests waiting in one line for
it (batch.py's ``Batches``): each time it is free it takes the oldest and every
later one that can share its call, up to ``max_batch_size``, having waited up to
``gather_ms`` from the oldest one's arrival for others sent with it. A step-end
callback carries previews back to the event loop and is where a cancelled run stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, ClassVar

from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from services.engines.base import (
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    ModelInfo,
    ProgressOutput,
    SamplingParams,
)
from services.engines.defaults import DefaultLayers, resolve
from services.engines.diffusers.batch import Batches, Done, Job, Member
from services.engines.diffusers.checks import check_request
from services.engines.diffusers.config import BUILT_IN, DiffusersArgs
from services.engines.diffusers.loading import (
    cross_attention_dim,
    load_pipeline,
    model_bytes,
    native_size,
)
from services.engines.prompt_size import PromptBound, longest_token_chars
from services.engines.scheduler.loop_post import loop_post
from services.engines.text_intake import EMBEDS
from services.mesh.errors import Cancelled, FailedPrecondition, InitFailed

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DiffusersPlan(EnginePlan):
    job: Job  # the pipeline call, every default filled in


class DiffusersEngine:
    name: ClassVar[str] = "diffusers"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {
            "num_inference_steps",
            "guidance_scale",
            "height",
            "width",
            "seed",
            "preview_every",
            "return_png",
        }
    )
    output_tensors: ClassVar[tuple[str, ...]] = ("image",)
    settings_model: ClassVar[type[DiffusersArgs]] = DiffusersArgs

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._args = DiffusersArgs.of(settings)
        self._defaults = DefaultLayers(settings.defaults, self._args.request_defaults, BUILT_IN)
        self._pipe: DiffusionPipeline | None = None
        self._batches: Batches | None = None
        self._members: dict[str, Member] = {}  # by request id: waiting or running
        self._prompt_bound: PromptBound | None = None  # None: the pipeline has no tokenizer

    @property
    def pipeline(self) -> DiffusionPipeline:
        if self._pipe is None:
            raise FailedPrecondition("the diffusers engine has no pipeline loaded")
        return self._pipe

    @property
    def waiting(self) -> int:
        """Requests in line for the pipeline (metrics, tests)."""
        return 0 if self._batches is None else self._batches.waiting

    def load(self, model_path: Path | None) -> ModelInfo:
        pipe, description = load_pipeline(self._settings, self._args, model_path)
        self._pipe = pipe
        if self._batches is not None:
            self._batches.close()
        gather_s = self._args.gather_ms / 1e3
        self._batches = Batches(pipe, self._settings.max_batch_size, gather_s)
        tokenizers = [
            tokenizer
            for name in ("tokenizer", "tokenizer_2", "tokenizer_3")
            if (tokenizer := getattr(pipe, name, None)) is not None
        ]
        if tokenizers:
            chars = max(longest_token_chars(tokenizer) for tokenizer in tokenizers)
            self._prompt_bound = PromptBound(self._settings.max_prompt_tokens, chars)
        size = model_bytes(pipe)
        logger.info("loaded %s on %s: %d bytes", description, self._settings.device, size)
        return ModelInfo(model_bytes=size, kv=None, description=description)

    def warmup(self) -> None:
        request = EngineRequest("warmup", text="warmup", params=SamplingParams(seed=0))
        job = dataclasses.replace(self._job(request), steps=1)
        outcome: list[ProgressOutput | Done] = []
        ended = threading.Event()

        def emit(item: ProgressOutput | Done) -> None:
            outcome.append(item)
            if isinstance(item, Done):
                ended.set()

        self._line().submit(Member(job, threading.Event(), emit))
        ended.wait()
        done = outcome[-1]
        if isinstance(done, Done) and done.error is not None:
            raise InitFailed("the diffusers warm-up run failed (see the stage log)") from done.error
        logger.info("diffusers warm-up done")

    def check(self, request: EngineRequest) -> DiffusersPlan:
        embed_dim = None if self._pipe is None else cross_attention_dim(self._pipe)
        params = resolve(request.params, self._defaults)
        check_request(request, params, self._args, embed_dim, self._prompt_bound)
        return DiffusersPlan(request, self._job(request))

    async def generate(self, plan: DiffusersPlan) -> AsyncGenerator[EngineEvent, None]:
        request, job = plan.request, plan.job
        post = loop_post(asyncio.get_running_loop())
        queue: asyncio.Queue[ProgressOutput | Done] = asyncio.Queue()

        def emit(item: ProgressOutput | Done) -> None:  # a closed loop drops it
            post.post(queue.put_nowait, item)

        member = Member(job, threading.Event(), emit)
        batches = self._line()
        batches.submit(member)
        self._members[request.request_id] = member
        try:
            while True:
                item = await queue.get()
                if isinstance(item, ProgressOutput):
                    yield item
                    continue
                if item.interrupted:
                    raise Cancelled(f"request {request.request_id} was aborted")
                if item.error is not None:
                    raise item.error
                for event in item.events:
                    yield event
                return
        finally:
            # Reached on completion, error, aclose() or task cancellation alike: a
            # waiting request never starts, a running batch drops it (and stops at
            # its next step once none of its members is left).
            member.cancel.set()
            batches.withdraw(member)
            if self._members.get(request.request_id) is member:
                del self._members[request.request_id]

    def close(self) -> None:
        for member in list(self._members.values()):
            member.cancel.set()
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        self._pipe = None

    def _line(self) -> Batches:
        if self._batches is None:
            raise FailedPrecondition("the diffusers engine has no pipeline loaded")
        return self._batches

    def _job(self, request: EngineRequest) -> Job:
        params = resolve(request.params, self._defaults)
        pipe = self.pipeline
        call: dict[str, Any] = {}
        embeds = request.tensors.get(EMBEDS)
        if embeds is None:
            call["prompt"] = request.text
        else:
            call["prompt_embeds"] = embeds if embeds.ndim == 3 else embeds.unsqueeze(0)
        height, width = params.height, params.width
        native = native_size(pipe)
        if native is not None:
            height, width = height or native, width or native
        if height is not None:
            call["height"] = height
        if width is not None:
            call["width"] = width
        # BUILT_IN sets all three.
        assert params.num_inference_steps is not None and params.guidance_scale is not None
        assert params.preview_every is not None
        return Job(
            request_id=request.request_id,
            call=call,
            steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            seed=params.seed,
            preview_every=params.preview_every,
            return_png=params.return_png,
        )
