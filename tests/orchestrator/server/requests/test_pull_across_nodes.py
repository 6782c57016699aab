"""Stages on different nodes: the thinker's hidden states reach the renderer by a
pull from the thinker's data port, not through the orchestrator. Real stage
processes told they run on two nodes (OMNI_NODE_NAME), a real orchestrator."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.engines.video.source import pattern_frames
from services.mesh.tensors import codec
from tests.orchestrator.conftest import (
    RENDER_DIM,
    THINK_TO_RENDER,
    Stages,
    orchestrator,
    pipeline,
    renderer_config,
    segmented_thinker,
)

ROOT = Path(__file__).resolve().parents[4]
FRAMES, WINDOW, SIDE = 12, 4, 256  # a window of 4 frames: 768 KiB
PARAMS = {"max_tokens": 24, "seed": 6, "return_hidden_states": True}


@pytest.fixture(scope="module")
async def nodes(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path
) -> AsyncIterator[tuple[Stages, Stages]]:
    """Node a: the thinker and a renderer beside it; node b: another renderer."""
    a = Stages(tmp_path_factory.mktemp("node-a"), env={"OMNI_NODE_NAME": "node-a"})
    b = Stages(tmp_path_factory.mktemp("node-b"), env={"OMNI_NODE_NAME": "node-b"})
    try:
        await a.start(
            {
                # 1 KiB segments, each over pull_min_bytes too: pulled by node b.
                "thinker": segmented_thinker(omni_cache_dir, pull_min_bytes=1024),
                "renderer": renderer_config(omni_cache_dir),
            }
        )
        await b.start({"renderer": renderer_config(omni_cache_dir)})
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def across(a: Stages, renderer: Stages):
    both = Stages(a.folder)
    both.addresses = {"thinker": a.addresses["thinker"], "renderer": renderer.addresses["renderer"]}
    return pipeline(both, ["thinker", "renderer"], THINK_TO_RENDER, outputs=["thinker", "renderer"])


async def test_hidden_states_reach_another_node_by_pull_and_the_client_gets_bytes(nodes) -> None:
    a, b = nodes
    images, states = {}, {}
    for where, renderer in (("same node", a), ("other node", b)):
        async with orchestrator(across(a, renderer)) as (server, client):
            generate = client.generate(
                "Draw a river.",
                params=PARAMS,
                stage_params={"renderer": {"seed": 1}},
                request_id="river",
            )
            result = await generate.collect()
            assert result.ok, (where, result.done)
            thinker = result.stages["thinker"]
            # The client asked for the hidden states too: bytes, whichever way they went.
            hidden = codec.from_proto(codec.concat_raw(thinker.tensors["hidden_states"], "h"))
            assert hidden.shape == (24, RENDER_DIM)
            (image,) = result.stages["renderer"].tensors["image"]
            images[where] = codec.from_proto(image)
            states[where] = hidden
            # Refs, not the 6 KiB of states, crossed the orchestrator from the thinker
            # towards the renderer (the client's copy is counted apart).
            assert server.router.recent_bytes["river"]["thinker"] < 24 * RENDER_DIM * 4
    # The renderer on the other node was conditioned on exactly the same states.
    assert torch.equal(states["same node"], states["other node"])
    assert images["same node"].dtype == torch.uint8
    assert torch.equal(images["same node"], images["other node"])


@pytest.mark.slow
async def test_frames_reach_a_stage_on_another_node_exactly(tmp_path: Path) -> None:
    runtime = {"torch_threads": 1, "inline_max_bytes": 64 << 10, "pull_min_bytes": 64 << 10}
    env = {"PYTHONPATH": str(ROOT)}
    a = Stages(tmp_path / "a", env={**env, "OMNI_NODE_NAME": "node-a"})
    b = Stages(tmp_path / "b", env={**env, "OMNI_NODE_NAME": "node-b"})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    frames = {"frames": FRAMES, "window_frames": WINDOW, "height": SIDE, "width": SIDE}
    try:
        await a.start(
            {
                "frames": {
                    "name": "frames",
                    "engine": "video_frames",
                    "load_format": "dummy",
                    "engine_args": frames,
                    "runtime": runtime,
                }
            }
        )
        await b.start(
            {
                "echo": {
                    "name": "echo",
                    "engine": "tests.helpers.echo_tensors:EchoTensorsEngine",
                    "load_format": "dummy",
                    "runtime": runtime,
                }
            }
        )
        both = Stages(tmp_path)
        both.addresses = {**a.addresses, **b.addresses}
        edges = [{"from": "frames", "to": "echo"}]
        config = pipeline(both, ["frames", "echo"], edges, outputs=["echo"])
        async with orchestrator(config) as (server, client):
            results = [
                await client.generate("go", params={"seed": s}, request_id=f"r{s}").collect()
                for s in (3, 4)
            ]
            through = [server.router.recent_bytes[f"r{s}"]["frames"] for s in (3, 4)]
    finally:
        await a.stop()
        await b.stop()
    window_bytes = WINDOW * SIDE * SIDE * 3
    for seed, result, crossed in zip((3, 4), results, through, strict=True):
        assert result.ok, result.done
        got = torch.cat([codec.from_proto(t) for t in result.stages["echo"].tensors["frames"]])
        assert torch.equal(got, pattern_frames(FRAMES, SIDE, SIDE, seed)), f"seed {seed}"
        # Three windows of 768 KiB went by pull: the orchestrator carried refs alone.
        assert crossed < window_bytes // 8, crossed
