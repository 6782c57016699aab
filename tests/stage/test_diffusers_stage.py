"""A diffusers stage over a real gRPC channel, from a real pipeline folder."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from services.engines.diffusers import build_dummy_pipeline
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from tests.helpers.stage import collect


@pytest.fixture(scope="module")
async def renderer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("pipeline")
    build_dummy_pipeline(cross_attention_dim=32, sample_size=8).save_pretrained(folder)
    config = parse_stage_config(
        {
            "name": "renderer",
            "engine": "diffusers",
            "model": str(folder),
            "defaults": {"num_inference_steps": 6},
        }
    )
    server = StageServer(config)
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=120)
        yield client
    await server.stop(1.0)


def render(request_id: str, **params: object) -> stage_pb2.Submit:
    return stage_pb2.Submit(
        request_id=request_id,
        inputs=stage_pb2.StageInputs(text="a red square"),
        params=stage_pb2.GenerationParams(**params),
        is_last=True,
    )


async def test_renders_an_image_with_previews_and_png(renderer: StageClient) -> None:
    result = (
        await collect(renderer.generate(render("img", preview_every=2, return_png=True, seed=3)))
    )["img"]
    assert result.error is None and result.completed.finish_reason == "done"
    assert [p.step for p in result.progress] == [2, 4, 6]
    assert all(p.total_steps == 6 and p.preview.dtype == "uint8" for p in result.progress)
    (segment,) = result.segments
    assert segment.is_last and segment.sequence == 0
    image = codec.from_proto(segment.tensors[0])
    assert segment.tensors[0].name == "image" and image.dtype == torch.uint8
    assert image.shape == (16, 16, 3)
    (blob,) = segment.blobs
    assert blob.media_type == "image/png"
    assert Image.open(io.BytesIO(blob.data)).size == (16, 16)


async def test_prompt_embeds_condition_the_renderer(renderer: StageClient) -> None:
    submit = render("emb", seed=1)
    submit.inputs.text = ""
    submit.inputs.tensors.append(codec.to_proto(torch.randn(5, 32), "prompt_embeds"))
    result = (await collect(renderer.generate(submit)))["emb"]
    assert result.completed is not None
    assert result.completed.usage.prompt_tokens == 5  # the rows it conditioned on
    bad = render("bad")
    bad.inputs.text = ""
    bad.inputs.tensors.append(codec.to_proto(torch.randn(5, 31), "prompt_embeds"))
    error = (await collect(renderer.generate(bad)))["bad"].error
    assert error.code_name == "INVALID_ARGUMENT" and "prompt_embeds" in error.field


async def test_sampling_params_of_a_text_engine_are_refused(renderer: StageClient) -> None:
    error = (await collect(renderer.generate(render("t", max_tokens=3))))["t"].error
    assert error.code_name == "INVALID_ARGUMENT" and error.field == "params.max_tokens"
