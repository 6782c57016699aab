"""An engine writing its output straight into the producer's pooled shared
blocks, end to end over real processes: frame source stage -> orchestrator ->
a stage that echoes what it received. The consumer must get the source's exact
frames, and a second request must reuse the first one's blocks (no new /dev/shm
file) once the orchestrator released them.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from services.engines.video.source import pattern_frames
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from tests.helpers.shm_blocks import inodes_of
from tests.orchestrator.conftest import Stages, orchestrator, pipeline

ROOT = Path(__file__).resolve().parents[4]
FRAMES, WINDOW, SIDE = 12, 4, 256  # a window of 4 frames is 768 KiB: a 1 MiB pooled block


@pytest.mark.slow
async def test_frames_written_into_pool_blocks_reach_the_consumer_and_blocks_are_reused(
    tmp_path: Path,
) -> None:
    mesh = f"pool{uuid.uuid4().hex[:8]}"
    stages = Stages(tmp_path, env={"PYTHONPATH": str(ROOT), "OMNI_MESH_ID": mesh})
    runtime = {"torch_threads": 1, "inline_max_bytes": 64 << 10}
    try:
        await stages.start(
            {
                "frames": {
                    "name": "frames",
                    "engine": "video_frames",
                    "load_format": "dummy",
                    "engine_args": {
                        "frames": FRAMES,
                        "window_frames": WINDOW,
                        "height": SIDE,
                        "width": SIDE,
                    },
                    "runtime": runtime,
                },
                "echo": {
                    "name": "echo",
                    "engine": "tests.helpers.echo_tensors:EchoTensorsEngine",
                    "load_format": "dummy",
                    "runtime": runtime,
                },
            }
        )
        config = pipeline(
            stages, ["frames", "echo"], [{"from": "frames", "to": "echo"}], outputs=["echo"]
        )
        async with orchestrator(config, mesh=mesh) as (_server, client):
            results, files = [], []
            async with StageClient(stages.addresses["frames"]) as frames:
                for seed in (3, 4):
                    rid = f"req-{seed}"
                    generate = client.generate("go", params={"seed": seed}, request_id=rid)
                    results.append(await generate.collect())
                    # The orchestrator releases in the background; this call returns once
                    # the blocks are back in the pool, whoever's release came first.
                    await frames.release_tensors(stage_pb2.ReleaseTensorsRequest(request_id=rid))
                    files.append(inodes_of(mesh))
    finally:
        await stages.stop()
    for seed, result in zip((3, 4), results, strict=True):
        assert result.ok, result.done
        echo = result.stages["echo"]
        got = torch.cat([codec.from_proto(t) for t in echo.tensors["frames"]])
        assert torch.equal(got, pattern_frames(FRAMES, SIDE, SIDE, seed)), f"seed {seed}"
        assert echo.completed is not None and echo.completed.usage.prompt_tokens == FRAMES
    # Request 1's three windows went out in three pooled blocks; request 2 wrote
    # into the very same files (same inodes), renamed again once released.
    first, second = files
    assert len(first) == FRAMES // WINDOW
    assert set(second.values()) == set(first.values())
    assert not set(second) & set(first)
    assert inodes_of(mesh) == {}  # the stage unlinked its pool when it stopped
