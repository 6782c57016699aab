"""/v1/images/generations through a real gateway over a thinker and a diffusion
renderer: the OpenAI SDK gets the renderer's image as a base64 PNG, the image
the gRPC client gets for the same prompt and seed; a pipeline without an image
stage refuses, naming the model."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from services.testing.configs import tiny_config
from tests.gateway.conftest import MODEL, Mesh, mesh_over
from tests.orchestrator.conftest import THINK_TO_RENDER, Stages, renderer_config


@pytest.fixture(scope="module")
async def drawing(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Mesh]:
    stages = Stages(tmp_path_factory.mktemp("drawing"))
    runtime = {"torch_threads": 1}
    try:
        await stages.start(
            {
                "thinker": tiny_config("thinker", omni_cache_dir, runtime=runtime),
                "renderer": renderer_config(omni_cache_dir),
            }
        )
        # As the default pipeline: the thinker's text and the renderer's image both reach clients.
        outputs = ["thinker", "renderer"]
        async with mesh_over(stages, stages.folder, edges=THINK_TO_RENDER, outputs=outputs) as mesh:
            yield mesh
    finally:
        await stages.stop()


async def test_the_sdk_gets_the_renderers_image_as_a_png(drawing: Mesh) -> None:
    prompt = "A red apple."
    # As the gateway asks: the stages' defaults (the thinker's greedy), a PNG.
    direct = await drawing.client.generate(
        prompt, stage_params={"renderer": {"return_png": True}}
    ).collect()
    assert direct.ok, direct.done
    (blob,) = direct.stages["renderer"].blobs

    sdk = OpenAI(base_url=drawing.base_url, api_key="x", max_retries=0, timeout=120)
    reply = await asyncio.to_thread(lambda: sdk.images.generate(model=MODEL, prompt=prompt))
    (item,) = reply.data
    png = base64.b64decode(item.b64_json or "")
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    assert image.size == Image.open(io.BytesIO(blob.data)).size
    # The renderer drew from the thinker's answer: the gateway says what it was.
    assert item.revised_prompt == direct.stages["thinker"].text != ""

    # Chat completions on the same pipeline answer with the thinker's text alone.
    chat = await asyncio.to_thread(
        lambda: sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}]
        )
    )
    assert chat.choices[0].message.content == direct.stages["thinker"].text


async def test_a_pipeline_without_an_image_stage_refuses_naming_the_model(mesh: Mesh) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{mesh.base_url}/images/generations", json={"model": MODEL, "prompt": "An apple."}
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
    assert "no stage that draws images" in response.json()["error"]["message"]
