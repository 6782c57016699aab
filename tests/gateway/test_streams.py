"""Streams through a real gateway: a client that goes away mid-stream (or before
a non-streamed answer is ready) cancels its request in the mesh, and concurrent
streams each get the answer they would get alone."""

from __future__ import annotations

import asyncio
import json

import httpx
from openai import AsyncOpenAI

from services.mesh.rpc.stage_client import StageClient
from tests.gateway.conftest import MODEL, Mesh
from tests.helpers.polling import eventually
from tests.orchestrator.conftest import Stages

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long essay."}]}


async def _settled(mesh: Mesh, timeout_s: float = 10.0) -> bool:
    """The orchestrator holds no request (polled)."""
    router = mesh.server.router
    await eventually(lambda: router.in_flight == 0, timeout_s, message="a request is held")
    return True


async def _stage_holds(smollm2: Stages, request_id: str) -> bool:
    async with StageClient(smollm2.addresses["thinker"]) as stage:
        return list((await stage.abort(request_id)).not_found) != [request_id]


async def test_a_client_gone_mid_stream_cancels_its_request(mesh: Mesh, smollm2: Stages) -> None:
    body = {**LONG, "max_tokens": 2000, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{mesh.base_url}/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            chunks = (json.loads(line[6:]) async for line in reply.aiter_lines() if line)
            first = await anext(chunks)
            texts = 0
            while texts < 3:
                texts += bool((await anext(chunks))["choices"][0]["delta"].get("content"))
            assert mesh.server.router.in_flight == 1
        # Leaving the block closed the connection with the answer half told.
    assert await _settled(mesh), "the orchestrator still holds the request"
    assert not await _stage_holds(smollm2, first["id"])


async def test_a_client_gone_before_its_answer_cancels_its_request(mesh: Mesh) -> None:
    body = {**LONG, "max_tokens": 2000}
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=1.0)) as http:
        try:
            await http.post(f"{mesh.base_url}/chat/completions", json=body)
            raise AssertionError("2000 tokens came in under a second")
        except httpx.ReadTimeout:
            pass  # the client gives up and closes the connection
    assert await _settled(mesh), "the orchestrator still holds the request"


async def test_concurrent_streams_each_get_their_own_answer(mesh: Mesh) -> None:
    prompts = [f"Count from {n} to {n + 5}." for n in range(1, 9)]  # 8 streams, 4 batched
    params = {"max_tokens": 12, "temperature": 0.0}
    expected = [
        (await mesh.client.generate(p, params=params).collect()).stages["thinker"].text
        for p in prompts
    ]
    sdk = AsyncOpenAI(base_url=mesh.base_url, api_key="x", max_retries=0, timeout=120)

    async def stream(prompt: str) -> str:
        chunks = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, **params
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    got = await asyncio.gather(*(stream(p) for p in prompts))
    await sdk.close()
    assert got == expected
    assert await _settled(mesh)
