"""examples/pipelines/video.yaml under the real orchestrator and stage processes:
the frame source's segments reach the upscaler in windows of 4 as they are made,
and the client gets every frame, upscaled, one segment per model window."""

from __future__ import annotations

from pathlib import Path

import torch

from orchestrator.cli.launcher import Launcher
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import load_pipeline
from services.engines.video.source import pattern_frames
from services.mesh.tensors import codec

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "pipelines"


async def test_video_example_upscales_every_frame(tmp_path: Path) -> None:
    launcher = Launcher(
        load_pipeline(EXAMPLES / "video.yaml"), run_dir=tmp_path / "run", mesh_id="exvideo", port=0
    )
    try:
        await launcher.start()
        async with AsyncClient(launcher.address) as client:
            await client.wait_ready(timeout_s=120)
            result = await client.generate("go", params={"seed": 4}).collect()
    finally:
        await launcher.stop()
    assert result.ok, result.done
    upscaler = result.stages["upscaler"]
    pieces = [codec.from_proto(t) for t in upscaler.tensors["frames"]]
    # 32 frames of 32x32 from the source, in model windows of 4, each upscaled x2.
    assert [tuple(p.shape) for p in pieces] == [(4, 3, 64, 64)] * 8
    assert upscaler.completed is not None and upscaler.completed.usage.completion_tokens == 32
    video = torch.cat(pieces).float()
    source = pattern_frames(32, 32, 32, seed=4).float()
    base = torch.nn.functional.interpolate(source, scale_factor=2, mode="bilinear")
    assert (video - base).abs().mean() < 40  # the source's frames, upscaled
