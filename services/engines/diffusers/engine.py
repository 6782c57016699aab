"""``DiffusersEngine``: any local ``DiffusionPipeline``, one image at a time.

The pipeline runs on one worker thread the engine owns (a pipeline keeps per-call
state on itself, so two runs must never overlap). A step-end callback carries
previews back to the event loop and is where a cancelled run stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from services.engines.base import (
    Blob,
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    ProgressOutput,
    SamplingParams,
    TensorOutput,
)
from services.engines.diffusers.checks import PROMPT_EMBEDS, check_request
from services.engines.diffusers.config import DiffusersArgs
from services.engines.diffusers.images import encode_png, latent_preview, to_uint8_image
from services.engines.diffusers.loading import (
    cross_attention_dim,
    load_pipeline,
    model_bytes,
    native_size,
)
from services.mesh.errors import Cancelled, FailedPrecondition, InitFailed

logger = logging.getLogger(__name__)


class _Interrupted(Exception):
    """Raised inside the step callback: it leaves the pipeline at a step boundary and
    skips the remaining steps and the VAE decode (``pipe._interrupt`` would still
    decode, and not every pipeline honours it)."""


@dataclasses.dataclass(frozen=True)
class _Done:
    """The worker's last word on a run: its final events, its error, or that it was
    interrupted."""

    events: tuple[EngineEvent, ...] = ()
    error: BaseException | None = None
    interrupted: bool = False


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

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._args = DiffusersArgs.from_engine_args(settings.engine_args)
        self._pipe: DiffusionPipeline | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusers")
        self._runs: dict[str, _Run] = {}  # by request id: queued or running

    @property
    def pipeline(self) -> DiffusionPipeline:
        if self._pipe is None:
            raise FailedPrecondition("the diffusers engine has no pipeline loaded")
        return self._pipe

    def load(self, model_path: Path | None) -> ModelInfo:
        pipe, description = load_pipeline(self._settings, self._args, model_path)
        self._pipe = pipe
        size = model_bytes(pipe)
        logger.info("loaded %s on %s: %d bytes", description, self._settings.device, size)
        return ModelInfo(model_bytes=size, kv=None, description=description)

    def warmup(self) -> None:
        request = EngineRequest("warmup", text="warmup", params=SamplingParams(seed=0))
        job = dataclasses.replace(self._job(request), steps=1)
        outcome: list[ProgressOutput | _Done] = []
        self._executor.submit(self._run, job, threading.Event(), outcome.append).result()
        done = outcome[-1]
        if isinstance(done, _Done) and done.error is not None:
            raise InitFailed("the diffusers warm-up run failed (see the stage log)") from done.error
        logger.info("diffusers warm-up done")

    def check(self, request: EngineRequest) -> None:
        embed_dim = None if self._pipe is None else cross_attention_dim(self._pipe)
        check_request(request, self._args, embed_dim)

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineEvent, None]:
        self.check(request)
        job = self._job(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[ProgressOutput | _Done] = asyncio.Queue()

        def emit(item: ProgressOutput | _Done) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass

        cancel = threading.Event()
        run = _Run(cancel, emit, self._executor.submit(self._run, job, cancel, emit))
        self._runs[request.request_id] = run
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
            # Reached on completion, error, aclose() or task cancellation alike: a run
            # still queued never starts, a running one stops at its next step.
            cancel.set()
            run.future.cancel()
            if self._runs.get(request.request_id) is run:
                del self._runs[request.request_id]

    def close(self) -> None:
        for run in list(self._runs.values()):
            run.cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._pipe = None

    def _job(self, request: EngineRequest) -> _Job:
        params = request.params
        pipe = self.pipeline
        call: dict[str, Any] = {}
        embeds = request.tensors.get(PROMPT_EMBEDS)
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
        preview_every = params.preview_every
        return _Job(
            request_id=request.request_id,
            call=call,
            steps=params.num_inference_steps or self._args.num_inference_steps,
            guidance_scale=(
                self._args.guidance_scale
                if params.guidance_scale is None
                else params.guidance_scale
            ),
            seed=params.seed,
            preview_every=self._args.preview_every if preview_every is None else preview_every,
            return_png=params.return_png,
        )

    def _run(
        self,
        job: _Job,
        cancel: threading.Event,
        emit: Callable[[ProgressOutput | _Done], None],
    ) -> None:
        """Runs on the worker thread; always ends by emitting one ``_Done``."""
        if cancel.is_set():  # cancelled while waiting for the thread
            emit(_Done(interrupted=True))
            return
        try:
            image = self._denoise(job, cancel, emit)
        except _Interrupted:
            logger.info("diffusers request %s: stopped at a step boundary", job.request_id)
            emit(_Done(interrupted=True))
            return
        except Exception as exc:  # handed to the consumer, which raises it
            logger.exception("diffusers request %s failed", job.request_id)
            emit(_Done(error=exc))
            return
        blobs = (Blob("image", "image/png", encode_png(image)),) if job.return_png else ()
        # prompt_tokens: the prompt-embedding rows it conditioned on (an upstream hand-off).
        rows = job.call["prompt_embeds"].shape[-2] if "prompt_embeds" in job.call else 0
        finish = FinishOutput("done", prompt_tokens=rows)
        emit(_Done(events=(TensorOutput({"image": image}, blobs), finish)))

    def _denoise(
        self,
        job: _Job,
        cancel: threading.Event,
        emit: Callable[[ProgressOutput | _Done], None],
    ) -> torch.Tensor:
        pipe = self.pipeline
        call = dict(job.call)
        device, dtype = pipe.device, pipe.dtype
        if "prompt_embeds" in call:
            embeds = call["prompt_embeds"].to(device=device, dtype=dtype)
            call["prompt_embeds"] = embeds
            if job.guidance_scale > 1.0:
                # An upstream model's hidden states have no "empty prompt" of their
                # own; zeros are the neutral condition for guidance.
                call["negative_prompt_embeds"] = torch.zeros_like(embeds)
        # Not torch.seed(): that would reseed the process-wide generator.
        seed = secrets.randbits(63) if job.seed is None else job.seed
        generator = torch.Generator(device="cpu").manual_seed(seed)
        inputs = getattr(pipe, "_callback_tensor_inputs", ())
        tensor_inputs = ["latents"] if "latents" in inputs else []

        def on_step_end(
            pipe: DiffusionPipeline, i: int, _t: Any, kwargs: dict[str, Any]
        ) -> dict[str, Any]:
            if cancel.is_set():
                raise _Interrupted
            step = i + 1
            if job.preview_every and step % job.preview_every == 0:
                total = getattr(pipe, "num_timesteps", None) or job.steps
                latents = kwargs.get("latents")
                preview = latent_preview(latents) if latents is not None else None
                emit(ProgressOutput(step=step, total_steps=total, preview=preview))
            return kwargs

        # Every concrete pipeline is callable; the base class does not say so.
        run_pipeline = cast(Callable[..., Any], pipe)
        out = run_pipeline(
            **call,
            num_inference_steps=job.steps,
            guidance_scale=job.guidance_scale,
            generator=generator,
            output_type="np",
            callback_on_step_end=on_step_end,
            callback_on_step_end_tensor_inputs=tensor_inputs,
        )
        return to_uint8_image(out.images[0])


@dataclasses.dataclass(frozen=True)
class _Run:
    """A submitted request: its stop flag, its way back to the loop, its place in line."""

    cancel: threading.Event
    emit: Callable[[ProgressOutput | _Done], None]
    future: Future[None]


@dataclasses.dataclass(frozen=True)
class _Job:
    """One resolved request: the pipeline's inputs with every default filled in."""

    request_id: str
    call: dict[str, Any]  # prompt or prompt_embeds, height, width
    steps: int
    guidance_scale: float
    seed: int | None
    preview_every: int = 0
    return_png: bool = False
