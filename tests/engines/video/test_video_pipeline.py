"""The window pipeline of the video engine: off, basic and aggressive give the
same frames bit for bit, the order checks catch a schedule that writes a window
out of order, and device 1 really finishes window t-1 while device 0 runs t."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from services.engines.video.config import ModelShape
from services.engines.video.devices import Span, Timeline
from services.engines.video.model import WindowOrderError, build_weights
from services.engines.video.pipeline import Op, Step, WindowPipeline, schedule

SHAPE = ModelShape(dim=16, heads=2, blocks=4, window_frames=2, kv_windows=2)
MODES = ("off", "basic", "aggressive")


def clip(frames: int, seed: int = 1, side: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, 3, side, side), dtype=torch.uint8, generator=gen)


async def upscale(
    mode: str,
    calls: list[torch.Tensor],
    *,
    shape: ModelShape = SHAPE,
    split: int = 1,
    devices: tuple[str, str] = ("cpu", "cpu"),
    steps: list[Step] | None = None,
    check_order: bool = True,
    emulated_block_s: float = 0.0,
    timeline: Timeline | None = None,
) -> list[tuple[int, torch.Tensor]]:
    """Every window's output of one stream whose frames arrive in ``calls``."""
    pipeline = WindowPipeline(
        shape,
        build_weights(shape),
        devices,
        mode,  # type: ignore[arg-type]
        split,
        emulated_block_s=emulated_block_s,
        timeline=timeline,
    )
    try:
        state = pipeline.new_state(check_order)
        outputs = []
        for frames in calls:
            windows = pipeline.plan(state, frames, request_seed=3)
            async for index, out in pipeline.run(state, windows, steps):
                outputs.append((index, out))
        return outputs
    finally:
        pipeline.close()


def assert_same(a: list[tuple[int, torch.Tensor]], b: list[tuple[int, torch.Tensor]]) -> None:
    assert [i for i, _ in a] == [i for i, _ in b]
    for (index, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), f"window {index} differs"


@pytest.mark.parametrize("frames", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("split", [0, 1, 2])
async def test_every_mode_gives_the_one_device_frames(frames: int, split: int) -> None:
    video = clip(frames)
    reference = await upscale("off", [video], split=split)
    windows = -(-frames // SHAPE.window_frames)
    assert [i for i, _ in reference] == list(range(windows))
    joined = torch.cat([out for _, out in reference])
    assert joined.shape == (frames, 3, 16, 16) and joined.dtype == torch.uint8
    for mode in ("basic", "aggressive"):
        assert_same(await upscale(mode, [video], split=split), reference)


async def test_the_output_is_an_upscale_of_the_input() -> None:
    video = clip(4)
    out = torch.cat([o for _, o in await upscale("aggressive", [video])]).float()
    base = torch.nn.functional.interpolate(video.float(), scale_factor=2, mode="bilinear")
    # The head adds detail to a bilinear upscale; the decoder blends frames over time.
    assert (out - base).abs().mean() < 40
    other = torch.cat([o for _, o in await upscale("aggressive", [clip(4, seed=2)])]).float()
    assert (out - other).abs().mean() > 40  # the frames come from the input, not the weights


async def test_windows_continue_across_calls() -> None:
    """A stream's state (KV caches, input projection, decoder, positions) carries
    over from call to call: frames cut at window borders give the same output."""
    video = clip(12)
    whole = await upscale("aggressive", [video])
    for mode in MODES:
        assert_same(await upscale(mode, [video[:2], video[2:8], video[8:]]), whole)


async def test_more_blocks_and_a_longer_cache() -> None:
    shape = dataclasses.replace(SHAPE, blocks=6, kv_windows=3, window_frames=3)
    video = clip(16)
    reference = await upscale("off", [video], shape=shape, split=2)
    for mode in ("basic", "aggressive"):
        for split in (0, 4):
            assert_same(
                await upscale(mode, [video], shape=shape, split=split),
                await upscale("off", [video], shape=shape, split=split),
            )
        assert_same(await upscale(mode, [video], shape=shape, split=2), reference)


def moved_after(steps: list[Step], step: Step, anchor: Step) -> list[Step]:
    out = [s for s in steps if s != step]
    out.insert(out.index(anchor) + 1, step)
    return out


def blocks_out_of_order() -> list[Step]:
    """The off schedule with window 2's blocks run before window 1's."""
    A, B, C, E = Op.PREPARE, Op.FRONT, Op.BACK, Op.EMIT
    return [
        *[Step(A, 0), Step(B, 0), Step(C, 0), Step(E, 0)],
        *[Step(A, 1), Step(A, 2), Step(B, 2), Step(B, 1)],
        *[Step(C, 1), Step(E, 1), Step(C, 2), Step(E, 2)],
    ]


async def test_an_out_of_order_kv_write_is_caught() -> None:
    video = clip(6)
    with pytest.raises(WindowOrderError, match="KV cache write for window 2, expected window 1"):
        await upscale("off", [video], steps=blocks_out_of_order())
    # Why the check exists: without it the same schedule silently changes the frames.
    reference = await upscale("off", [video])
    unchecked = await upscale("off", [video], steps=blocks_out_of_order(), check_order=False)
    assert torch.equal(unchecked[0][1], reference[0][1])  # window 0 ran in order
    assert not torch.equal(unchecked[1][1], reference[1][1])
    assert not torch.equal(unchecked[2][1], reference[2][1])


async def test_finishing_windows_out_of_order_is_caught() -> None:
    video = clip(6)
    steps = moved_after(schedule("aggressive", 3), Step(Op.BACK, 1), Step(Op.BACK, 2))
    assert steps.index(Step(Op.BACK, 2)) < steps.index(Step(Op.BACK, 1))
    with pytest.raises(WindowOrderError):
        await upscale("aggressive", [video], steps=steps)
    reference = await upscale("aggressive", [video])
    unchecked = await upscale("aggressive", [video], steps=steps, check_order=False)
    assert not torch.equal(unchecked[1][1], reference[1][1])


def overlaps(a: Span, b: Span) -> bool:
    return a.start < b.end and b.start < a.end


async def test_device_1_finishes_window_t_minus_1_while_device_0_runs_window_t() -> None:
    windows = 5
    for mode in ("basic", "aggressive"):
        timeline = Timeline()
        await upscale(mode, [clip(2 * windows)], emulated_block_s=0.05, timeline=timeline)
        dev0 = {s.label: s for s in timeline.of("dev0")}
        dev1 = {s.label: s for s in timeline.of("dev1")}
        copy = {s.label: s for s in timeline.of("copy")}
        assert sorted(dev1) == [f"C{t}" for t in range(windows)]
        for t in range(windows):
            # The copy starts after the blocks that made it, device 1 after the copy.
            assert dev0[f"B{t}"].end <= copy[f"X{t}"].start
            assert copy[f"X{t}"].end <= dev1[f"C{t}"].start
            if t:
                assert overlaps(dev1[f"C{t - 1}"], dev0[f"B{t}"]), (mode, t)
    timeline = Timeline()
    await upscale("off", [clip(2 * windows)], emulated_block_s=0.005, timeline=timeline)
    assert not timeline.of("dev1") and not timeline.of("copy")
    spans = sorted(timeline.of("dev0"), key=lambda s: s.start)
    assert all(a.end <= b.start for a, b in itertools.pairwise(spans))  # one queue, in order


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA variant needs a CUDA GPU"
)


@pytest.mark.gpu
@needs_cuda
async def test_cuda_streams_give_the_one_device_frames() -> None:
    # Two GPUs when there are two; otherwise two streams of one GPU stand in.
    devices = ("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")
    video = clip(13, side=16)
    reference = await upscale("off", [video], devices=devices)
    for mode in ("basic", "aggressive"):
        for split in (0, 2):
            assert_same(
                await upscale(mode, [video], devices=devices, split=split),
                await upscale("off", [video], devices=devices, split=split),
            )
        assert_same(await upscale(mode, [video[:4], video[4:]], devices=devices), reference)
