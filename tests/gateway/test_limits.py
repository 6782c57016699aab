"""The gateway's own connection limit (``--max-connections``, uvicorn's
limit_concurrency): a flood of requests past it is answered 503 at once, none of
those reaches the mesh, and a client that comes after the flood is served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from openai import AsyncOpenAI

from tests.gateway.conftest import MODEL, Mesh, mesh_over
from tests.orchestrator.conftest import Stages

LIMIT = 4
FLOOD = 24


@pytest.fixture(scope="module")
async def limited(smollm2: Stages, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    args = {"args": ["--max-connections", str(LIMIT), "--backlog", "64"]}
    async with mesh_over(smollm2, tmp_path_factory.mktemp("limited"), gateway_args=args) as mesh:
        yield mesh


async def test_a_flood_past_the_limit_is_refused_and_the_next_client_served(
    limited: Mesh,
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long essay."}],
        "max_tokens": 48,
        "stream": True,
    }
    before = limited.server.router.completed
    pool = httpx.Limits(max_connections=FLOOD, max_keepalive_connections=0)

    async def one(http: httpx.AsyncClient) -> int:
        async with http.stream("POST", f"{limited.base_url}/chat/completions", json=body) as r:
            await r.aread()
            return r.status_code

    async with httpx.AsyncClient(timeout=120, limits=pool) as http:
        statuses = await asyncio.gather(*(one(http) for _ in range(FLOOD)))
    served = statuses.count(200)
    assert set(statuses) <= {200, 503}, statuses
    # Every request's headers arrive long before a 48-token answer ends: at most
    # LIMIT of them are taken, the rest refused at once.
    assert served <= LIMIT and statuses.count(503) >= FLOOD - LIMIT, statuses
    # Only the served ones cost the mesh anything.
    assert limited.server.router.completed - before == served

    sdk = AsyncOpenAI(base_url=limited.base_url, api_key="x", max_retries=0, timeout=60)
    reply = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    await sdk.close()
    assert reply.choices[0].message.content
