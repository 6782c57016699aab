"""One pipeline call for several requests: they denoise as one batch, on the
pipeline's one thread (``Batches``).

Requests batch when the call cannot tell them apart but by their prompt and
seed: the same size, step count, guidance scale and kind of prompt (text, or
embeddings of the same length). Each keeps its own seed (a generator per
image), its own previews and its own stop flag; the batch stops early only once
every member has been cancelled, and a cancelled member's image is dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, cast

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from services.engines.base import (
    Blob,
    EngineEvent,
    FinishOutput,
    ProgressOutput,
    TensorOutput,
)
from services.engines.diffusers.images import encode_png, latent_preview, to_uint8_image
from services.engines.scheduler.worker import Worker

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Done:
    """The worker's last word on a request: its final events, its error, or that it
    was interrupted."""

    events: tuple[EngineEvent, ...] = ()
    error: BaseException | None = None
    interrupted: bool = False


Emit = Callable[[ProgressOutput | Done], None]


@dataclasses.dataclass(frozen=True)
class Job:
    """One resolved request: the pipeline's inputs with every default filled in."""

    request_id: str
    call: dict[str, Any]  # prompt or prompt_embeds, height, width
    steps: int
    guidance_scale: float
    seed: int | None
    preview_every: int = 0
    return_png: bool = False

    @property
    def batch_key(self) -> Hashable:
        """Jobs with equal keys can share one pipeline call."""
        embeds = self.call.get("prompt_embeds")
        prompt = "text" if embeds is None else ("embeds", tuple(embeds.shape[-2:]))
        size = (self.call.get("height"), self.call.get("width"))
        return (self.steps, self.guidance_scale, size, prompt)


@dataclasses.dataclass(frozen=True)
class Member:
    """A job in the engine's line: its stop flag and its way back to the loop."""

    job: Job
    cancel: threading.Event
    emit: Emit
    arrived: float = dataclasses.field(default_factory=time.monotonic)


class _Interrupted(Exception):
    """Raised inside the step callback: it leaves the pipeline at a step boundary and
    skips the remaining steps and the VAE decode (``pipe._interrupt`` would still
    decode, and not every pipeline honours it)."""


class Batches:
    """The pipeline's one thread (scheduler/worker.py; a pipeline keeps per-call state on
    itself, so two runs must never overlap) and the line of members waiting for it, in
    arrival order. Each pass takes the oldest and every later one that can share its
    call, up to ``max_batch_size``, having waited up to ``gather_s`` from the oldest
    one's arrival for others sent with it (one that queued behind a running batch has,
    and starts at once)."""

    def __init__(self, pipe: DiffusionPipeline, max_batch_size: int, gather_s: float) -> None:
        self._pipe = pipe
        self._limit = max_batch_size
        self._gather_s = gather_s
        self._worker: Worker[Member, list[Member]] = Worker(
            "diffusers",
            "the diffusers engine",
            take=self._take,
            run=self._run,
            fail=self._failed,
            end=_end,
        )

    def submit(self, member: Member) -> None:
        self._worker.submit(member)

    def withdraw(self, member: Member) -> bool:
        """Take ``member`` out of the line; False when a batch has taken it already."""
        return self._worker.withdraw(member)

    @property
    def waiting(self) -> int:
        return self._worker.pending

    def close(self) -> None:
        """Once the batch running (if any) has stopped: its members were cancelled."""
        self._worker.close(None)

    def _take(self, waiting: list[Member]) -> list[list[Member]]:
        while True:
            if not waiting:
                return []
            head = waiting[0]
            batch = [m for m in waiting if m.job.batch_key == head.job.batch_key]
            batch = batch[: self._limit]
            left = head.arrived + self._gather_s - time.monotonic()
            if len(batch) >= self._limit or left <= 0:
                break
            self._worker.wait(left)
        for member in batch:
            waiting.remove(member)
        if len(batch) > 1:
            logger.debug("diffusers: %d requests share one batch", len(batch))
        return [batch]

    def _run(self, members: list[Member]) -> None:
        run_batch(self._pipe, members)

    def _failed(self, members: list[Member], error: Exception) -> None:
        """Handed to every consumer, which raises it."""
        logger.exception("diffusers batch %s failed", _ids(members))
        _end(members, error)


def _end(members: list[Member], error: Exception) -> None:
    for member in members:
        member.emit(Done(error=error))


def run_batch(pipe: DiffusionPipeline, members: list[Member]) -> None:
    """Runs on the worker thread; ends by emitting one ``Done`` to each member, or
    raises (Batches fails them)."""
    try:
        images = _denoise(pipe, members)
    except _Interrupted:
        logger.info("diffusers batch %s: stopped at a step boundary", _ids(members))
        for member in members:
            member.emit(Done(interrupted=True))
        return
    for member, image in zip(members, images, strict=True):
        if member.cancel.is_set():
            member.emit(Done(interrupted=True))
            continue
        job = member.job
        blobs = (Blob("image", "image/png", encode_png(image)),) if job.return_png else ()
        finish = FinishOutput("done", prompt_tokens=prompt_rows(job))
        member.emit(Done(events=(TensorOutput({"image": image}, blobs), finish)))


def prompt_rows(job: Job) -> int:
    """Usage.prompt_tokens: the prompt-embedding rows an upstream hand-off gave
    (0 for a text prompt, which the pipeline encodes itself)."""
    embeds = job.call.get("prompt_embeds")
    return 0 if embeds is None else int(embeds.shape[-2])


def _denoise(pipe: DiffusionPipeline, members: list[Member]) -> list[torch.Tensor]:
    jobs = [m.job for m in members]
    first = jobs[0]
    call = {k: v for k, v in first.call.items() if k not in ("prompt", "prompt_embeds")}
    device, dtype = pipe.device, pipe.dtype
    if "prompt_embeds" in first.call:
        embeds = torch.cat([j.call["prompt_embeds"] for j in jobs]).to(device=device, dtype=dtype)
        call["prompt_embeds"] = embeds
        if first.guidance_scale > 1.0:
            # An upstream model's hidden states have no "empty prompt" of their
            # own; zeros are the neutral condition for guidance.
            call["negative_prompt_embeds"] = torch.zeros_like(embeds)
    else:
        call["prompt"] = [j.call["prompt"] for j in jobs]
    # One generator per image: each draws its own latents exactly as it would alone.
    # Not torch.seed(): that would reseed the process-wide generator.
    generators = [
        torch.Generator(device="cpu").manual_seed(
            secrets.randbits(63) if j.seed is None else j.seed
        )
        for j in jobs
    ]
    inputs = getattr(pipe, "_callback_tensor_inputs", ())
    tensor_inputs = ["latents"] if "latents" in inputs else []

    def on_step_end(
        pipe: DiffusionPipeline, i: int, _t: Any, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        if all(m.cancel.is_set() for m in members):
            raise _Interrupted
        step = i + 1
        latents = kwargs.get("latents")
        total = getattr(pipe, "num_timesteps", None) or first.steps
        for row, member in enumerate(members):
            every = member.job.preview_every
            if member.cancel.is_set() or not every or step % every:
                continue
            preview = latent_preview(latents[row : row + 1]) if latents is not None else None
            member.emit(ProgressOutput(step=step, total_steps=total, preview=preview))
        return kwargs

    # Every concrete pipeline is callable; the base class does not say so.
    run_pipeline = cast(Callable[..., Any], pipe)
    out = run_pipeline(
        **call,
        num_inference_steps=first.steps,
        guidance_scale=first.guidance_scale,
        generator=generators if len(generators) > 1 else generators[0],
        output_type="np",
        callback_on_step_end=on_step_end,
        callback_on_step_end_tensor_inputs=tensor_inputs,
    )
    return [to_uint8_image(image) for image in out.images]


def _ids(members: list[Member]) -> str:
    return ",".join(m.job.request_id for m in members)
