"""The official OpenAI SDK (sync and async, streamed and not) and curl against a
real gateway over a real SmolLM2 stage: what each gets is what the gRPC client
gets for the same prompt (greedy: the same text), with usage from the stage."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest
from openai import AsyncOpenAI, OpenAI

from orchestrator.client import Result
from services.mesh.pb.omni.v1 import stage_pb2
from tests.gateway.conftest import MODEL, Mesh

PROMPT = "Tell me a long story about a dragon."
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
]
CURL = ["curl", "-sS", "--fail-with-body", "-N", "-H", "Content-Type: application/json"]
GREEDY = {"max_tokens": 16, "temperature": 0.0, "seed": 7}


async def _grpc_answer(mesh: Mesh) -> Result:
    """The same chat through the gRPC client (the system and user messages)."""
    inputs = stage_pb2.StageInputs(
        messages=[
            stage_pb2.ChatMessage(role="system", content="You are terse."),
            stage_pb2.ChatMessage(role="user", content=PROMPT),
        ]
    )
    result = await mesh.client.generate(inputs=inputs, params=GREEDY).collect()
    assert result.ok, result.done
    return result


@pytest.fixture(scope="module")
async def expected(mesh: Mesh) -> Result:
    return await _grpc_answer(mesh)


def _sdk(mesh: Mesh) -> OpenAI:
    return OpenAI(base_url=mesh.base_url, api_key="anything", max_retries=0, timeout=120)


async def test_models_lists_the_pipeline_with_its_stages(mesh: Mesh) -> None:
    models = await asyncio.to_thread(lambda: _sdk(mesh).models.list())
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0].model_dump()
    assert card["stages"] == [
        {
            "name": "thinker",
            "engine": "transformers",
            "state": "STAGE_READY",
            "output_tensors": ["hidden_states"],
            "accepts": ["text"],
        }
    ]
    retrieved = await asyncio.to_thread(lambda: _sdk(mesh).models.retrieve(MODEL))
    assert retrieved.id == MODEL


async def test_sync_sdk_gets_the_grpc_clients_greedy_answer(mesh: Mesh, expected: Result) -> None:
    thinker = expected.stages["thinker"]
    reply = await asyncio.to_thread(
        lambda: _sdk(mesh).chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    )
    assert reply.choices[0].message.content == thinker.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"  # 16 tokens, cut short
    assert thinker.completed is not None
    usage = thinker.completed.usage
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert reply.usage.completion_tokens == 16 == len(thinker.token_ids)
    assert reply.usage.total_tokens == usage.prompt_tokens + 16


async def test_sync_sdk_streams_the_same_text(mesh: Mesh, expected: Result) -> None:
    def stream() -> list:
        chunks = _sdk(mesh).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=16,
            temperature=0.0,
            seed=7,
        )
        return list(chunks)

    chunks = await asyncio.to_thread(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    pieces = [piece for piece in pieces if piece]
    assert len(pieces) > 1  # it streamed, not one lump at the end
    assert "".join(pieces) == expected.stages["thinker"].text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1


async def test_async_sdk_streamed_and_not(mesh: Mesh, expected: Result) -> None:
    sdk = AsyncOpenAI(base_url=mesh.base_url, api_key="anything", max_retries=0, timeout=120)
    text = expected.stages["thinker"].text
    reply = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert reply.choices[0].message.content == text
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, **GREEDY
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == text
    await sdk.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_gets_a_completion_and_a_stream(mesh: Mesh, expected: Result) -> None:
    body = {"model": MODEL, "messages": MESSAGES, **GREEDY}

    def curl(payload: dict) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CURL, f"{mesh.base_url}/chat/completions", "-d", json.dumps(payload)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    plain = await asyncio.to_thread(curl, body)
    assert plain.returncode == 0, plain.stderr
    reply = json.loads(plain.stdout)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"] == expected.stages["thinker"].text

    streamed = await asyncio.to_thread(curl, {**body, "stream": True})
    assert streamed.returncode == 0, streamed.stderr
    events = [e for e in streamed.stdout.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected.stages["thinker"].text
