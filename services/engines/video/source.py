"""``FrameSourceEngine``: a deterministic test-pattern video, the frame source
of an example pipeline in front of the upscaler.

Each request yields ``frames`` frames (uint8 [F, 3, H, W]) of a moving pattern
whose colours come from the request's seed, one segment per ``window_frames``
frames, so a windowed edge (``window: N``) hands the next stage N such chunks.
The prompt, if any, is ignored.
"""

from __future__ import annotations

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
    HeapBlocks,
    ModelInfo,
    OutputBlocks,
    ProgressOutput,
    TensorOutput,
)
from services.engines.defaults import DefaultLayers, resolve
from services.engines.request_checks import refuse_unknown_tensors
from services.engines.video.config import MAX_FRAMES, SourceArgs
from services.mesh.errors import InvalidArgument

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourcePlan(EnginePlan):
    frames: int
    height: int
    width: int
    seed: int


def pattern_frames(
    frames: int,
    height: int,
    width: int,
    seed: int,
    start: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 [frames, 3, height, width]: a gradient scrolling one pixel per frame
    and a square crossing it, in colours picked by ``seed``; written into ``out``
    when given (a shared block the stage sends on without a copy)."""
    colours = torch.rand(2, 3, generator=torch.Generator().manual_seed(seed))
    t = torch.arange(start, start + frames, dtype=torch.float32)[:, None, None]
    ys = torch.arange(height, dtype=torch.float32)[None, :, None]
    xs = torch.arange(width, dtype=torch.float32)[None, None, :]
    ramp = ((xs + ys + t) % (height + width)) / (height + width)  # [F, H, W]
    side = max(height, width) // 4
    left = (t * 2) % max(width - side, 1)
    square = (xs >= left) & (xs < left + side) & (ys >= height // 3) & (ys < height // 3 + side)
    image = ramp[:, None] * colours[0][None, :, None, None]
    image = torch.where(square[:, None], colours[1][None, :, None, None], image)
    if out is None:
        return (image * 255).round().to(torch.uint8)
    return out.copy_(image.mul_(255).round_())  # exact integers: the cast truncates nothing


class FrameSourceEngine:
    name: ClassVar[str] = "video_frames"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"seed", "height", "width", "extra.frames"}
    )
    output_tensors: ClassVar[tuple[str, ...]] = ("frames",)

    settings_model: ClassVar[type[SourceArgs]] = SourceArgs

    def __init__(self, settings: EngineSettings) -> None:
        self.args = SourceArgs.of(settings)
        self._defaults = DefaultLayers(settings.defaults)
        self._blocks: OutputBlocks = HeapBlocks()

    def use_output_blocks(self, blocks: OutputBlocks) -> None:
        self._blocks = blocks

    def load(self, model_path: Path | None) -> ModelInfo:
        return ModelInfo(model_bytes=0, description="test-pattern frame source")

    def warmup(self) -> None:
        pattern_frames(1, 8, 8, 0)

    def check(self, request: EngineRequest) -> SourcePlan:
        refuse_unknown_tensors(request, ())
        params = resolve(request.params, self._defaults)
        for name in ("height", "width"):
            side = getattr(params, name)
            if side is not None and not 8 <= side <= 1024:
                raise InvalidArgument(
                    f"{name} must be in 8..1024, got {side}", field=f"params.{name}"
                )
        frames = params.extra.get("frames")
        if frames is not None and (
            isinstance(frames, bool)
            or not isinstance(frames, int | float)
            or frames != int(frames)
            or not 1 <= frames <= MAX_FRAMES
        ):
            raise InvalidArgument(
                f"extra.frames must be an integer in 1..{MAX_FRAMES}, got {frames!r}",
                field="params.extra.frames",
            )
        args = self.args
        total = int(params.extra.get("frames", args.frames))
        height, width = params.height or args.height, params.width or args.width
        return SourcePlan(request, total, height, width, params.seed or 0)

    async def generate(self, plan: SourcePlan) -> AsyncGenerator[EngineEvent, None]:
        args, rid = self.args, plan.request.request_id
        total, height, width = plan.frames, plan.height, plan.width
        windows = -(-total // args.window_frames)
        for index, start in enumerate(range(0, total, args.window_frames)):
            count = min(args.window_frames, total - start)
            out = self._blocks.allocate(rid, (count, 3, height, width), torch.uint8)
            frames = pattern_frames(count, height, width, plan.seed, start, out=out)
            yield TensorOutput({"frames": frames})
            yield ProgressOutput(step=index + 1, total_steps=windows)  # one segment per window
        yield FinishOutput("done", completion_tokens=total)

    async def abort(self, request_id: str) -> None:
        """Nothing to do: a request stops at its next window when its consumer stops."""

    def close(self) -> None:
        pass
