"""OpenAI content parts through a real gateway and orchestrator to a real stage
process whose engine answers with what it got (services/testing/media_engine.py):
text, a data-URL image and input_audio reach it in order, byte for byte."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway.conftest import MODEL, Mesh, mesh_over
from tests.orchestrator.conftest import Stages

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * (3 << 12)  # 3 MiB: chunked on its way
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(64)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@asynccontextmanager
async def media_stage_mesh(folder: Path, **engine_args: object) -> AsyncIterator[Mesh]:
    stages = Stages(folder, env={"PYTHONPATH": str(ROOT)})
    config = {
        "name": "thinker",
        "engine": "services.testing.media_engine:MediaEngine",
        "engine_args": engine_args,
        "load_format": "dummy",
        "cache_dir": str(folder / "cache"),
        "runtime": {"max_message_bytes": 2 << 20},  # the image fits no single message
    }
    try:
        await stages.start({"thinker": config})
        async with mesh_over(stages, folder) as mesh:
            yield mesh
    finally:
        await stages.stop()


@pytest.fixture(scope="module")
async def media_mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    async with media_stage_mesh(tmp_path_factory.mktemp("media")) as mesh:
        yield mesh


def _ask(mesh: Mesh, content: list[dict]) -> str:
    sdk = OpenAI(base_url=mesh.base_url, api_key="anything", max_retries=0, timeout=60)
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}]
    )
    return reply.choices[0].message.content or ""


async def test_the_sdks_parts_reach_the_stage_in_order(media_mesh: Mesh) -> None:
    content = [
        {"type": "text", "text": "What is in the picture and the clip?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}},
        {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "wav"}},
    ]
    got = json.loads(await asyncio.to_thread(_ask, media_mesh, content))
    assert got["messages"] == [["user", "What is in the picture and the clip?"]]
    parts = got["turns"][0]["parts"]
    assert parts[0] == {"text": "What is in the picture and the clip?"}
    assert parts[1] == {
        "kind": "image",
        "media_type": "image/png",
        "nbytes": len(PNG),
        "sha256": hashlib.sha256(PNG).hexdigest(),
    }
    assert parts[2]["media_type"] == "audio/wav"
    assert parts[2]["sha256"] == hashlib.sha256(WAV).hexdigest()


async def test_models_say_what_the_stage_takes(media_mesh: Mesh) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        card = (await http.get(f"{media_mesh.base_url}/models")).json()["data"][0]
    assert card["stages"][0]["accepts"] == ["audio", "image", "text"]


IMAGE = "messages[0].content[0].image_url.url"


@pytest.mark.parametrize(
    ("part", "param", "says"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, IMAGE,
         "the gateway does not fetch URLs"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, IMAGE,
         "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, IMAGE,
         "text/plain is not an image type"),
        ({"type": "image_url", "image_url": {}}, IMAGE, "Field required"),
        ({"type": "input_audio", "input_audio": {"data": "aGk=", "format": "aac"}},
         "messages[0].content[0].input_audio.format", "Input should be 'wav' or 'mp3'"),
        ({"type": "file", "file": {}}, "messages[0].content[0].type", "expected text, image_url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}, IMAGE, "empty"),
    ],
)  # fmt: skip
async def test_bad_parts_are_400_naming_the_field(
    media_mesh: Mesh, part: dict, param: str, says: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{media_mesh.base_url}/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


async def test_a_stage_that_does_not_take_audio_refuses_it_by_name(tmp_path: Path) -> None:
    """The stage's own refusal, its field named as the request spelt the part."""
    audio = {"type": "input_audio", "input_audio": {"data": b64(b"ID3\x03"), "format": "mp3"}}
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}}
    async with media_stage_mesh(tmp_path, accepts=["text", "image"]) as mesh:
        got = json.loads(await asyncio.to_thread(_ask, mesh, [image]))
        assert got["turns"][0]["parts"][0]["sha256"] == hashlib.sha256(PNG).hexdigest()
        with pytest.raises(openai.BadRequestError) as refused:
            await asyncio.to_thread(_ask, mesh, [{"type": "text", "text": "hi"}, audio])
    assert refused.value.param == "messages[0].content[1]"
    assert "stage thinker takes text and image, not audio" in str(refused.value)
