"""``VideoEngine``: a streaming video upscaler whose blocks are split over two
devices, consecutive windows overlapping (see pipeline.py).

Input: ``frames``, uint8 [T, 3, H, W]; output: ``frames``, uint8
[T, 3, H*scale, W*scale], one segment per model window of ``window_frames``
frames, as each window is done.

How windows overlap in a stage. With ``runtime.streaming_input`` every input
window of a request is one ``generate`` call, and the runtime asks for the next
window only when the call has ended. A call cuts its frames into model windows
and pipelines them all: device 0 runs window t while device 1 finishes t-1.
Between calls the pipeline drains: the engine is not told which window is a
request's last, so none may still be in flight when a call returns (its output
could never be emitted). The model's state (KV caches, input projection,
decoder, window count) is kept per request id between calls (window_state.py), so a
request's output is the same however its frames are cut into calls at window borders. Overlap
therefore grows with the model windows one call carries: an edge ``window: N``
of a source that emits one model window per segment gives N per call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

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
from services.engines.defaults import DefaultLayers, resolve
from services.engines.request_checks import (
    check_seed,
    one_input,
    refuse_unknown_tensors,
    tensor_field,
)
from services.engines.video.config import VideoArgs
from services.engines.video.model import build_weights
from services.engines.video.pipeline import WindowPipeline
from services.engines.video.window_state import StreamStates
from services.mesh.errors import FailedPrecondition, InitFailed, InvalidArgument

logger = logging.getLogger(__name__)

FRAMES = "frames"
MAX_FRAME_SIDE = 1024
MAX_FRAMES_PER_CALL = 4096


@dataclass(frozen=True)
class VideoPlan(EnginePlan):
    frames: torch.Tensor  # uint8 [T, 3, H, W], checked
    seed: int


class VideoEngine:
    name: ClassVar[str] = "video"
    supported_params: ClassVar[frozenset[str]] = frozenset({"seed"})
    output_tensors: ClassVar[tuple[str, ...]] = (FRAMES,)
    settings_model: ClassVar[type[VideoArgs]] = VideoArgs

    def __init__(self, settings: EngineSettings) -> None:
        if settings.load_format != "dummy":
            raise InitFailed(
                "the video engine builds its seeded model from engine_args: set load_format: dummy",
                field="load_format",
            )
        self._settings = settings
        self.args = VideoArgs.of(settings)
        self._defaults = DefaultLayers(settings.defaults)
        self._pipeline: WindowPipeline | None = None
        self._streams = StreamStates(self.args.max_streams, self.args.stream_idle_s)

    @property
    def pipeline(self) -> WindowPipeline:
        if self._pipeline is None:
            raise FailedPrecondition("the video engine has no model loaded")
        return self._pipeline

    def load(self, model_path: Path | None) -> ModelInfo:
        args = self.args
        for device in args.devices:
            if device.startswith("cuda") and not torch.cuda.is_available():
                raise InitFailed(f"engine_args.devices: {device} but CUDA is not available")
        weights = build_weights(args.shape)
        self._pipeline = WindowPipeline(
            args.shape,
            weights,
            args.devices,
            args.mode,
            args.split_index,
            emulated_block_s=args.emulated_block_ms / 1e3,
        )
        description = (
            f"video upscaler x{args.shape.scale}: {args.shape.blocks} blocks, "
            f"0..{args.split_index} on {args.devices[0]}, the rest on {args.devices[1]}, "
            f"mode {args.mode}"
        )
        logger.info("loaded %s", description)
        return ModelInfo(model_bytes=weights.nbytes, kv=None, description=description)

    def warmup(self) -> None:
        pipeline = self.pipeline
        side = 4 * pipeline.shape.patch
        frames = torch.zeros(2 * pipeline.shape.window_frames, 3, side, side, dtype=torch.uint8)
        state = pipeline.new_state()

        async def run() -> None:
            async for _ in pipeline.run(state, pipeline.plan(state, frames, 0)):
                pass

        asyncio.run(run())
        logger.info("video warm-up done")

    def check(self, request: EngineRequest) -> VideoPlan:
        refuse_unknown_tensors(request, (FRAMES,))
        where = one_input(request, (tensor_field(FRAMES),))
        frames = request.tensors[FRAMES]
        patch = self.args.shape.patch
        if (
            frames.dtype != torch.uint8
            or frames.dim() != 4
            or frames.shape[1] != 3
            or not 1 <= frames.shape[0] <= MAX_FRAMES_PER_CALL
        ):
            raise InvalidArgument(
                f"{where}: expected uint8 [T, 3, H, W] with 1 <= T <= {MAX_FRAMES_PER_CALL}, "
                f"got {frames.dtype} {list(frames.shape)}",
                field=where,
            )
        height, width = frames.shape[2:]
        if any(side % patch or not patch <= side <= MAX_FRAME_SIDE for side in (height, width)):
            raise InvalidArgument(
                f"{where}: H and W must be multiples of {patch} up to {MAX_FRAME_SIDE}, "
                f"got {height}x{width}",
                field=where,
            )
        seed = resolve(request.params, self._defaults).seed
        check_seed(seed)
        return VideoPlan(request, frames, seed or 0)

    async def generate(self, plan: VideoPlan) -> AsyncGenerator[EngineEvent, None]:
        pipeline = self.pipeline
        rid, frames = plan.request.request_id, plan.frames
        state = self._streams.acquire(rid, pipeline.new_state)
        finished = False
        try:
            size = (int(frames.shape[2]), int(frames.shape[3]))
            if state.frame_size not in (None, size):
                raise InvalidArgument(
                    f"inputs.tensors.{FRAMES}: request {rid} has {state.frame_size} frames, "
                    f"this window {size}",
                    field=f"inputs.tensors.{FRAMES}",
                )
            state.frame_size = size
            windows = pipeline.plan(state, frames, plan.seed)
            async for index, upscaled in pipeline.run(state, windows):
                yield TensorOutput({FRAMES: upscaled})  # each window's frames: a segment
                yield ProgressOutput(step=index + 1, total_steps=state.windows)
            finished = True
            count = int(frames.shape[0])
            yield FinishOutput("done", prompt_tokens=count, completion_tokens=count)
        finally:
            self._streams.release(rid, keep=finished)

    def release(self, request_id: str) -> None:
        """The request has ended (the stage says so): its state goes at once."""
        self._streams.forget(request_id)

    def close(self) -> None:
        self._streams.clear()
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
