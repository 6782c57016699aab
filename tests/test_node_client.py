"""A client in another language: the Node.js example (examples/clients/node), on
@grpc/grpc-js with our .proto files loaded as they are, against a real orchestrator
over a real stage process. What Node receives must be what the Python client
receives for the same request (greedy: the same tokens, in order)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config
from tests.helpers.node import node_client as node_example
from tests.orchestrator.conftest import Stages, orchestrator, pipeline


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The example with its npm dependencies installed (once per checkout)."""
    return node_example("@grpc/grpc-js") / "generate.mjs"


@pytest.fixture(scope="module")
async def one_stage(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Stages]:
    stages = Stages(tmp_path_factory.mktemp("node"))
    runtime = {"torch_threads": 1, "max_batch_size": 2}
    try:
        await stages.start({"thinker": tiny_config("thinker", omni_cache_dir, runtime=runtime)})
        yield stages
    finally:
        await stages.stop()


async def _node(script: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        "node",
        str(script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_node_client_gets_what_the_python_client_gets(
    node_client: Path, one_stage: Stages
) -> None:
    async with orchestrator(pipeline(one_stage, ["thinker"], [])) as (server, client):
        address = f"127.0.0.1:{server.port}"
        prompt, params = "Name three colours.", {"max_tokens": 12, "temperature": 0.0}
        expected = await client.generate(prompt, params=params).collect()
        assert expected.ok, expected.done
        code, out, err = await _node(
            node_client, "--json", "--address", address, "--max-tokens", "12",
            "--temperature", "0", prompt,
        )  # fmt: skip
        assert code == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["done"]["code_name"] == "OK"
        thinker = result["stages"]["thinker"]
        assert thinker["token_ids"] == expected.stages["thinker"].token_ids
        assert len(thinker["token_ids"]) == 12
        assert thinker["text"] == expected.stages["thinker"].text


async def test_node_client_sees_a_refusal_as_a_done_naming_the_field(
    node_client: Path, one_stage: Stages
) -> None:
    async with orchestrator(pipeline(one_stage, ["thinker"], [])) as (server, _client):
        address = f"127.0.0.1:{server.port}"
        code, out, err = await _node(
            node_client, "--json", "--address", address, "--temperature=-1", "hi"
        )
        assert code == 1, err
        done = json.loads(out.strip().splitlines()[-1])["done"]
        assert done["code_name"] == "INVALID_ARGUMENT"
        assert done["field"] == "params.temperature" and done["stage"] == "thinker"
        # The mesh goes on: the Python client is served after the refusal.
        async with AsyncClient(address) as python:
            assert (await python.generate("hi", params={"max_tokens": 2}).collect()).ok


async def test_node_client_sends_an_image_part(node_client: Path, tmp_path: Path) -> None:
    """--image: the stage's engine gets the file's bytes as an image part, then the text
    (services/testing/media_engine.py answers with what it got)."""
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 64
    image = tmp_path / "dot.png"
    image.write_bytes(png)
    config = {
        "name": "thinker",
        "engine": "services.testing.media_engine:MediaEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path / "cache"),
    }
    stage = StageServer(parse_stage_config(config))
    stage_port = await stage.start("127.0.0.1", 0)
    config = parse_pipeline(
        {"name": "node", "stages": [{"name": "thinker", "address": f"127.0.0.1:{stage_port}"}]},
        "node.yaml",
    )
    try:
        async with orchestrator(config) as (server, _client):
            address = f"127.0.0.1:{server.port}"
            code, out, err = await _node(
                node_client, "--json", "--address", address, "--image", str(image), "What?"
            )
    finally:
        await stage.stop(1.0)
    assert code == 0, err
    text = json.loads(out.strip().splitlines()[-1])["stages"]["thinker"]["text"]
    parts = json.loads(text)["turns"][0]["parts"]
    assert parts == [
        {"kind": "image", "media_type": "image/png", "nbytes": len(png),
         "sha256": hashlib.sha256(png).hexdigest()},
        {"text": "What?"},
    ]  # fmt: skip
