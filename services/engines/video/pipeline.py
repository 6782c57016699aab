"""The window pipeline: one model split over two devices, consecutive windows
overlapping (device 0 on window t while device 1 finishes window t-1).

A window goes through four steps: A, prepare (input projection, noise,
patchify, positions) and B, the blocks up to the split, on device 0; X, the
split activation copied to device 1 on a side queue; C, the blocks after the
split, the head and the decoder, on device 1; then E, the host takes its frames.
A mode is nothing but the order in which the host submits these steps
(``schedule``); every device queue is in order, and each step names the work it
depends on, so whatever the mode, every stateful part (input projection, each
block's KV cache, decoder) sees the windows in window order and the output is
bit-identical to the one-device run (``off``).

- ``off``: everything on device 0, one window at a time (A B C E per window).
- ``basic``: per window t: A(t), C(t-1), B(t), X(t); then the host waits for t-1.
- ``aggressive``: A(0); per t: C(t-1), B(t), X(t), A(t+1); the host waits for
  t-2, so device 1 always has the next window queued and device 0 the next
  window prepared. Windows in flight are ``WindowCtx``s in a deque.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from services.engines.video import model
from services.engines.video.config import Mode, ModelShape
from services.engines.video.devices import DeviceQueue, Timeline, Work, copy_to
from services.engines.video.model import StreamState, Weights


class Op(enum.Enum):
    PREPARE = "A"
    FRONT = "B"  # blocks 0..split, device 0
    COPY = "X"
    BACK = "C"  # blocks split+1.., head, decoder, device 1
    EMIT = "E"


@dataclass(frozen=True)
class Step:
    op: Op
    window: int  # index into this run's windows

    def __repr__(self) -> str:
        return f"{self.op.value}{self.window}"


def schedule(mode: Mode, windows: int) -> list[Step]:
    """The order in which the host submits the steps of ``windows`` windows."""
    A, B, X, C, E = Op.PREPARE, Op.FRONT, Op.COPY, Op.BACK, Op.EMIT
    steps: list[Step] = []
    if mode == "off":
        for t in range(windows):
            steps += [Step(A, t), Step(B, t), Step(C, t), Step(E, t)]
    elif mode == "basic":
        for t in range(windows):
            steps.append(Step(A, t))
            if t:
                steps.append(Step(C, t - 1))
            steps += [Step(B, t), Step(X, t)]
            if t:
                steps.append(Step(E, t - 1))
        if windows:
            steps += [Step(C, windows - 1), Step(E, windows - 1)]
    else:
        if windows:
            steps.append(Step(A, 0))
        for t in range(windows):
            if t:
                steps.append(Step(C, t - 1))
            steps += [Step(B, t), Step(X, t)]
            if t + 1 < windows:
                steps.append(Step(A, t + 1))
            if t >= 2:
                steps.append(Step(E, t - 2))
        if windows:
            steps.append(Step(C, windows - 1))
        steps += [Step(E, t) for t in range(max(windows - 2, 0), windows)]
    return steps


@dataclass
class WindowCtx:
    """One window in flight: fixed when it arrives, then its steps' work."""

    index: int  # in the request's stream
    frame_offset: int
    seed: int
    frames: torch.Tensor  # uint8 [F, 3, H, W] on the host
    prepared: Work | None = None
    front: Work | None = None
    copied: Work | None = None
    back: Work | None = None


class WindowPipeline:
    """The model's weights placed over two device queues, and the steps that run
    on them. Several streams (requests) may share it; each has its own state."""

    def __init__(
        self,
        shape: ModelShape,
        weights: Weights,
        devices: tuple[str, str],
        mode: Mode,
        split: int,
        *,
        emulated_block_s: float = 0.0,
        timeline: Timeline | None = None,
    ) -> None:
        self.shape = shape
        self.mode = mode
        self.split = split
        self._emulated = emulated_block_s
        dev0 = torch.device(devices[0])
        dev1 = dev0 if mode == "off" else torch.device(devices[1])
        self.timeline = timeline
        self._q0 = DeviceQueue("dev0", dev0, timeline)
        # Off: one device, one queue; the pipelined modes add device 1 and a side copy queue.
        self._q1 = self._q0 if mode == "off" else DeviceQueue("dev1", dev1, timeline)
        self._copy = None if mode == "off" else DeviceQueue("copy", dev1, timeline)
        self._embed = weights.embed.to(dev0)
        self._blocks = tuple(
            block.to(dev0 if i <= split else dev1) for i, block in enumerate(weights.blocks)
        )
        self._head = weights.head.to(dev1)

    def new_state(self, check_order: bool = True) -> StreamState:
        return model.new_state(self.shape, check_order)

    def plan(self, state: StreamState, frames: torch.Tensor, request_seed: int) -> list[WindowCtx]:
        """Cut ``frames`` [T, 3, H, W] into windows; each window's index, position
        offset and noise seed are fixed here, in arrival order."""
        windows = []
        for chunk in frames.split(self.shape.window_frames):
            index = state.windows
            seed = model.window_seed(self.shape, request_seed, index)
            windows.append(WindowCtx(index, state.frames, seed, chunk))
            state.windows += 1
            state.frames += chunk.shape[0]
        return windows

    async def run(
        self,
        state: StreamState,
        windows: Sequence[WindowCtx],
        steps: Sequence[Step] | None = None,
    ) -> AsyncIterator[tuple[int, torch.Tensor]]:
        """Submit ``steps`` (the mode's schedule by default) and yield each
        window's upscaled uint8 frames [F, 3, sH, sW] at its EMIT step."""
        steps = schedule(self.mode, len(windows)) if steps is None else steps
        in_flight: deque[WindowCtx] = deque()
        for step in steps:
            ctx = windows[step.window]
            if step.op is Op.PREPARE:
                in_flight.append(ctx)
                ctx.prepared = self._q0.submit(f"A{ctx.index}", partial(self._prepare, state, ctx))
            elif step.op is Op.FRONT:
                assert ctx.prepared is not None, f"{step} before its PREPARE"
                work = partial(self._run_blocks, state, ctx, range(self.split + 1))
                ctx.front = self._q0.submit(f"B{ctx.index}", work, ctx.prepared)
            elif step.op is Op.COPY:
                assert ctx.front is not None and self._copy is not None, f"{step} out of place"
                ctx.copied = copy_to(self._copy, f"X{ctx.index}", ctx.front, self._q1.device)
            elif step.op is Op.BACK:
                source = ctx.copied if self._copy is not None else ctx.front
                assert source is not None, f"{step} before its input"
                ctx.back = self._q1.submit(
                    f"C{ctx.index}", partial(self._finish, state, ctx), source
                )
            else:
                assert ctx.back is not None, f"{step} before its BACK"
                if in_flight and in_flight[0] is ctx:
                    in_flight.popleft()
                else:
                    in_flight.remove(ctx)  # only a mutated schedule emits out of order
                frames = await asyncio.to_thread(ctx.back.wait)
                yield ctx.index, frames.cpu()

    def close(self) -> None:
        for queue in {self._q0, self._q1, self._copy}:
            if queue is not None:
                queue.close()

    def _prepare(self, state: StreamState, ctx: WindowCtx) -> tuple[torch.Tensor, torch.Tensor]:
        return model.embed(
            self.shape, self._embed, state, ctx.index, ctx.frames, ctx.frame_offset, ctx.seed
        )

    def _run_blocks(
        self,
        state: StreamState,
        ctx: WindowCtx,
        indices: range,
        inputs: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, frames = inputs
        for i in indices:
            x = model.run_block(self.shape, self._blocks[i], state.kv[i], ctx.index, x)
            if self._emulated:
                time.sleep(self._emulated)  # emulated device time: releases the GIL
        return x, frames

    def _finish(
        self, state: StreamState, ctx: WindowCtx, inputs: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x, frames = self._run_blocks(state, ctx, range(self.split + 1, self.shape.blocks), inputs)
        return model.head_and_decode(self.shape, self._head, state, ctx.index, x, frames)
