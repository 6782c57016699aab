"""A video upscaler stage over real gRPC: frame windows in as they arrive
(runtime.streaming_input), upscaled frames out as one segment per model window,
the same frames as the one-device engine, and bad windows refused by name."""

from __future__ import annotations

import pytest
import torch

from services.engines.base import EngineRequest, EngineSettings, TensorOutput
from services.engines.video import VideoEngine
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.engine_runs import generate
from tests.helpers.stage import collect

MODEL = {"dim": 16, "heads": 2, "blocks": 4, "window_frames": 2, "seed": 5}


@pytest.fixture(scope="module")
async def upscaler(tmp_path_factory: pytest.TempPathFactory):
    config = {
        "name": "upscaler",
        "engine": "video",
        "load_format": "dummy",
        "engine_args": {**MODEL, "devices": ["cpu", "cpu"], "mode": "aggressive"},
        "cache_dir": str(tmp_path_factory.mktemp("cache")),
        "runtime": {"streaming_input": True, "torch_threads": 1},
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=60)
        yield server, client
    await server.stop(1.0)


def clip(count: int, side: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, 256, (count, 3, side, side), dtype=torch.uint8, generator=gen)


def window(rid: str, seq: int, last: bool, frames: torch.Tensor | None) -> stage_pb2.StageInput:
    submit = stage_pb2.Submit(request_id=rid, sequence=seq, is_last=last)
    if frames is not None:
        submit.inputs.tensors.append(codec.to_proto(frames, "frames"))
    return stage_pb2.StageInput(submit=submit)


async def one_device(frames: torch.Tensor) -> list[torch.Tensor]:
    engine = VideoEngine(EngineSettings(load_format="dummy", engine_args={**MODEL, "mode": "off"}))
    engine.load(None)
    try:
        request = EngineRequest("reference", tensors={"frames": frames})
        return [
            e.tensors["frames"]
            async for e in generate(engine, request)
            if isinstance(e, TensorOutput)
        ]
    finally:
        engine.close()


async def test_windows_are_upscaled_as_they_arrive(upscaler) -> None:
    server, client = upscaler
    video = clip(10)
    call = client.open_stream()
    await call.write(window("v", 0, False, video[:4]))  # two model windows
    first = await call.read()  # window 0's frames, before the next window was sent
    assert first.segment.request_id == "v" and first.segment.sequence == 0
    await call.write(window("v", 1, False, video[4:6]))
    await call.write(window("v", 2, False, video[6:]))
    await call.write(window("v", 3, True, None))  # an empty last window ends the input
    await call.done_writing()
    result = (await collect(call))["v"]
    segments = [first.segment, *result.segments]
    assert [s.sequence for s in segments] == list(range(len(segments)))
    frames = [codec.from_proto(t) for s in segments for t in s.tensors]
    assert [tuple(f.shape) for f in frames] == [(2, 3, 16, 16)] * 5
    expected = await one_device(video)
    assert all(torch.equal(a, b) for a, b in zip(frames, expected, strict=True))
    assert segments[-1].is_last and not segments[-1].tensors  # the closing segment
    assert result.completed is not None and result.completed.usage.completion_tokens == 10
    assert server.runtime.in_flight == 0


async def test_a_bad_window_ends_only_its_request(upscaler) -> None:
    server, client = upscaler
    call = client.open_stream()
    await call.write(window("bad", 0, False, clip(2)))
    await call.write(window("bad", 1, True, clip(2).float()))
    await call.write(window("good", 0, True, clip(2)))
    await call.done_writing()
    results = await collect(call)
    assert results["bad"].error.code_name == "INVALID_ARGUMENT"
    assert results["bad"].error.field == "inputs.tensors.frames"
    assert results["good"].completed is not None
    assert len(results["good"].segments) == 2  # one window, then the closing segment
    assert server.runtime.in_flight == 0
