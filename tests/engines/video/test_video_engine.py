"""The video engine behind the Protocol: engine_args validated by name, input
checked, windows of one request continued across generate calls, state per
request and dropped when a request is cut short; and the frame source."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.engines.base import (
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ProgressOutput,
    SamplingParams,
    TensorOutput,
)
from services.engines.registry import engine_class
from services.engines.video.config import VideoArgs
from services.engines.video.engine import VideoEngine
from services.engines.video.source import FrameSourceEngine
from services.engines.video.window_state import StreamStates
from services.mesh.errors import (
    FailedPrecondition,
    InitFailed,
    InvalidArgument,
    ResourceExhausted,
)
from services.testing.engine_runs import generate

ARGS = {"dim": 16, "heads": 2, "blocks": 4, "window_frames": 2}


def engine(**args: Any) -> VideoEngine:
    settings = EngineSettings(load_format="dummy", engine_args={**ARGS, **args})
    video = VideoEngine(settings)
    video.load(None)
    return video


def frames(count: int, side: int = 8, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, side, side), dtype=torch.uint8, generator=gen)


def request(rid: str, video: torch.Tensor, seed: int | None = None) -> EngineRequest:
    return EngineRequest(rid, tensors={"frames": video}, params=SamplingParams(seed=seed))


async def upscaled(video_engine: VideoEngine, req: EngineRequest) -> list[torch.Tensor]:
    outs = []
    async for event in generate(video_engine, req):
        if isinstance(event, TensorOutput):
            outs.append(event.tensors["frames"])
    return outs


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"mode": "fast"}, "engine_args.mode"),
        ({"split": 3}, "engine_args.split"),
        ({"split": "half"}, "engine_args.split"),
        ({"devices": ["cpu"]}, "engine_args.devices"),
        ({"devices": ["cpu", "tpu:0"]}, "engine_args.devices"),
        ({"devices": ["cpu", "cuda:0"]}, "engine_args.devices"),
        ({"blocks": 1}, "engine_args.blocks"),
        ({"dim": 15}, "engine_args.dim"),
        ({"layers": 4}, "engine_args.layers"),
        ({"emulated_block_ms": -1}, "engine_args.emulated_block_ms"),
    ],
)
def test_bad_engine_args_are_refused_by_name(args: dict[str, Any], field: str) -> None:
    with pytest.raises(InitFailed) as caught:
        VideoArgs.of(EngineSettings(engine_args={**ARGS, **args}))
    assert caught.value.field == field


@pytest.mark.parametrize(("blocks", "split"), [(2, 0), (3, 0), (4, 1), (6, 2), (9, 3)])
def test_auto_split_is_half_the_blocks_minus_one(blocks: int, split: int) -> None:
    args = VideoArgs.model_validate({"blocks": blocks, "split": "auto"})
    assert args.split_index == split
    assert VideoArgs.model_validate({"blocks": blocks, "split": blocks - 2}).split_index == (
        blocks - 2
    )


def test_the_registry_knows_both_engines() -> None:
    assert engine_class("video") is VideoEngine
    assert engine_class("video_frames") is FrameSourceEngine


def test_a_model_file_is_refused() -> None:
    with pytest.raises(InitFailed) as caught:
        VideoEngine(EngineSettings(load_format="auto"))
    assert caught.value.field == "load_format"


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (EngineRequest("r", text="hi", tensors={"frames": frames(2)}), "inputs"),
        (EngineRequest("r", tensors={"video": frames(2)}), "inputs.tensors.video"),
        (EngineRequest("r"), "inputs.tensors.frames"),
        (EngineRequest("r", tensors={"frames": frames(2).float()}), "inputs.tensors.frames"),
        (EngineRequest("r", tensors={"frames": frames(2)[:, :1]}), "inputs.tensors.frames"),
        (EngineRequest("r", tensors={"frames": frames(2, side=7)}), "inputs.tensors.frames"),
    ],
)
def test_bad_input_is_refused_by_name(req: EngineRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        engine().check(req)
    assert caught.value.field == field


async def test_one_segment_per_window_and_usage() -> None:
    video_engine = engine()
    events = [e async for e in generate(video_engine, request("r", frames(5)))]
    kinds = [type(e).__name__ for e in events]
    # A progress event after each window's frames makes the runtime flush them.
    assert kinds == ["TensorOutput", "ProgressOutput"] * 3 + ["FinishOutput"]
    progress = [e for e in events if isinstance(e, ProgressOutput)]
    assert [(p.step, p.total_steps) for p in progress] == [(1, 3), (2, 3), (3, 3)]
    finish = events[-1]
    assert isinstance(finish, FinishOutput) and finish.completion_tokens == 5
    video_engine.close()


async def test_a_request_continues_across_calls_and_requests_are_apart() -> None:
    video_engine = engine(mode="aggressive")
    video = frames(8)
    whole = await upscaled(video_engine, request("whole", video))
    pieces = []
    for chunk in (video[:2], video[2:6], video[6:]):
        pieces += await upscaled(video_engine, request("cut", chunk))
    assert len(pieces) == len(whole) == 4
    assert all(torch.equal(a, b) for a, b in zip(pieces, whole, strict=True))
    # A new request starts from a fresh state: its first window is window 0 again.
    again = await upscaled(video_engine, request("other", video[:2]))
    assert torch.equal(again[0], whole[0])
    seeded = await upscaled(video_engine, request("seeded", video[:2], seed=9))
    assert not torch.equal(seeded[0], whole[0])  # the noise seed is per request and window
    video_engine.close()


async def test_a_window_of_another_size_is_refused() -> None:
    video_engine = engine()
    await upscaled(video_engine, request("r", frames(2, side=8)))
    with pytest.raises(InvalidArgument) as caught:
        await upscaled(video_engine, request("r", frames(2, side=16)))
    assert caught.value.field == "inputs.tensors.frames"
    video_engine.close()


async def test_a_request_cut_short_loses_its_state() -> None:
    video_engine = engine()
    events = generate(video_engine, request("r", frames(6)))
    assert isinstance(await anext(events), TensorOutput)
    await events.aclose()  # the consumer stopped: cancellation at a window boundary
    with pytest.raises(FailedPrecondition, match="dropped"):
        await upscaled(video_engine, request("r", frames(2)))
    video_engine.close()


def test_stream_states_expire_and_make_room() -> None:
    now = [0.0]
    states = StreamStates(capacity=2, idle_s=10, clock=lambda: now[0])
    new = VideoEngine(EngineSettings(load_format="dummy", engine_args=ARGS))
    new.load(None)
    make = new.pipeline.new_state
    first = states.acquire("a", make)
    assert states.acquire("b", make) is not first
    with pytest.raises(InvalidArgument):
        states.acquire("a", make)  # still busy with a call
    with pytest.raises(ResourceExhausted):
        states.acquire("c", make)  # both busy: nothing may be evicted
    states.release("a", keep=True)
    states.release("b", keep=True)
    now[0] = 1.0
    assert states.acquire("a", make) is first
    states.release("a", keep=True)
    now[0] = 5.0
    states.acquire("c", make)  # full: b, idle the longest, makes room
    assert "b" not in states and "a" in states
    with pytest.raises(FailedPrecondition):
        states.acquire("b", make)
    now[0] = 100.0
    states.release("c", keep=True)
    states.acquire("d", make)
    assert "a" not in states  # idle past idle_s
    new.close()


async def test_the_frame_source_emits_one_segment_per_window() -> None:
    source = FrameSourceEngine(
        EngineSettings(engine_args={"frames": 10, "window_frames": 4, "height": 8, "width": 16})
    )
    source.check(EngineRequest("s", text="go"))
    events = [e async for e in generate(source, EngineRequest("s", text="go"))]
    chunks = [e.tensors["frames"] for e in events if isinstance(e, TensorOutput)]
    assert [tuple(c.shape) for c in chunks] == [(4, 3, 8, 16), (4, 3, 8, 16), (2, 3, 8, 16)]
    assert sum(isinstance(e, ProgressOutput) for e in events) == 3
    again = [e async for e in generate(source, EngineRequest("t", text="go"))]
    assert torch.equal(chunks[2], again[4].tensors["frames"])  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument) as caught:
        source.check(EngineRequest("s", params=SamplingParams(extra={"frames": 0})))
    assert caught.value.field == "params.extra.frames"
