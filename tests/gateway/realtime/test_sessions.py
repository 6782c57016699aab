"""Many sessions at once on one gateway: 32 concurrent sessions each get a whole
spoken answer, the same one each (greedy, the same question), and the gateway's
memory is as flat after a second round of 32 as after the first."""

from __future__ import annotations

import asyncio

import psutil

from tests.gateway.conftest import MODEL, Mesh
from tests.helpers.polling import eventually
from tests.helpers.realtime import Turn, respond, sdk, until, user_text

SESSIONS = 32


async def _session(mesh: Mesh) -> Turn:
    async with sdk(mesh.base_url).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        await connection.conversation.item.create(item=user_text("Name a colour."))
        await until(connection, "conversation.item.done")
        return await respond(connection, max_output_tokens=6)


async def _round(mesh: Mesh) -> list[Turn]:
    return await asyncio.wait_for(
        asyncio.gather(*(_session(mesh) for _ in range(SESSIONS))), timeout=600
    )


async def test_32_concurrent_sessions_complete_and_memory_stays_flat(speaking: Mesh) -> None:
    gateway = psutil.Process(speaking.gateway.pid)
    first = await _round(speaking)
    assert [t.status for t in first] == ["incomplete"] * SESSIONS  # 6 tokens each
    assert len({(t.transcript, t.pcm) for t in first}) == 1 and first[0].pcm
    settled = gateway.memory_info().rss
    second = await _round(speaking)
    assert [(t.transcript, t.pcm) for t in second] == [
        (first[0].transcript, first[0].pcm)
    ] * SESSIONS

    def rss() -> int:
        return int(gateway.memory_info().rss)

    # After the sessions close the gateway holds what it held after the first round.
    await eventually(lambda: rss() < settled + (16 << 20), 30, message=lambda: f"RSS {rss()}")
    after = rss()
    print(f"gateway RSS: {settled >> 20} MiB after round 1, {after >> 20} MiB after round 2")
