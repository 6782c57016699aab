"""A client in another language through the gateway: the Node.js example
(examples/clients/node/chat.mjs) on the official `openai` npm package, against
a real gateway over a real SmolLM2 stage. What it gets, streamed and not, is
what the gRPC client gets for the same prompt (greedy: the same text)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.gateway.conftest import MODEL, Mesh
from tests.helpers.node import node_client


@pytest.fixture(scope="module")
def chat_script() -> Path:
    """The example with its npm dependencies installed (once per checkout)."""
    return node_client("openai") / "chat.mjs"


async def _node(script: Path, mesh: Mesh, *args: str) -> tuple[int, dict, str]:
    process = await asyncio.create_subprocess_exec(
        "node", str(script), "--json", "--base-url", mesh.base_url, "--model", MODEL, *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, json.loads(out.decode().strip().splitlines()[-1]), err.decode()


async def test_node_openai_client_gets_what_the_grpc_client_gets(
    chat_script: Path, mesh: Mesh
) -> None:
    prompt = "Tell me a long story about a dragon."
    params = {"max_tokens": 12, "temperature": 0.0}
    expected = await mesh.client.generate(prompt, params=params).collect()
    assert expected.ok, expected.done
    thinker = expected.stages["thinker"]
    flags = ["--max-tokens", "12", "--temperature", "0", prompt]
    code, plain, err = await _node(chat_script, mesh, *flags)
    assert code == 0, err
    assert plain["text"] == thinker.text and plain["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 12
    code, streamed, err = await _node(chat_script, mesh, "--stream", *flags)
    assert code == 0, err
    assert streamed["text"] == thinker.text and streamed["chunks"] > 1
    assert streamed["usage"]["completion_tokens"] == 12


async def test_node_openai_client_sees_a_refusal_naming_the_field(
    chat_script: Path, mesh: Mesh
) -> None:
    code, result, _err = await _node(chat_script, mesh, "--temperature=-1", "hi")
    assert code == 1
    assert result["error"]["status"] == 400 and result["error"]["param"] == "temperature"
