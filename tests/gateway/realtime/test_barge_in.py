"""Barge-in: ``response.cancel`` in the middle of a spoken answer aborts its mesh
request. No audio delta of it follows its ``response.done`` (``cancelled``); the
stages stop holding it (read from each stage's own metrics, and the
orchestrator's router); and a session beside it on the same gateway gets the
answer it would have got alone."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from tests.gateway.conftest import MODEL, Mesh
from tests.gateway.realtime.conftest import MeteredStages
from tests.gateway.realtime.test_turns import PROMPT, chat
from tests.helpers.polling import eventually
from tests.helpers.realtime import read_turn, respond, sdk, until, user_text

STORY = "Tell me a very long story about a dragon who learns to sail."


async def _innocent(mesh: Mesh, started: asyncio.Event) -> Any:
    async with sdk(mesh.base_url).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        await connection.session.update(session={"type": "realtime", "max_output_tokens": 24})
        await until(connection, "session.updated")
        await connection.conversation.item.create(item=user_text(PROMPT))
        await until(connection, "conversation.item.done")
        await connection.response.create()
        started.set()
        return await read_turn(connection)


async def test_response_cancel_mid_audio(speaking: Mesh, metered: MeteredStages) -> None:
    expected = await asyncio.to_thread(chat, speaking, [{"role": "user", "content": PROMPT}], 24)
    async with sdk(speaking.base_url).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        await connection.session.update(session={"type": "realtime", "max_output_tokens": 1000})
        await until(connection, "session.updated")
        await connection.conversation.item.create(item=user_text(STORY))
        await until(connection, "conversation.item.done")
        innocent_started = asyncio.Event()
        innocent = asyncio.create_task(_innocent(speaking, innocent_started))
        await innocent_started.wait()
        await connection.response.create()
        before = await until(connection, "response.output_audio.delta")
        response_id = before[0]["response"]["id"]
        assert await metered.holding("thinker") > 0  # the stage holds it while it speaks
        await connection.response.cancel()
        rest = await until(connection, "response.done")
        done = rest[-1]["response"]
        assert done["id"] == response_id and done["status"] == "cancelled"
        assert done["status_details"]["reason"] == "client_cancelled"
        (item,) = done["output"]
        assert item["status"] == "incomplete"

        # The innocent session is untouched: what it would have got alone.
        turn = await asyncio.wait_for(innocent, 300)
        audio = expected.choices[0].message.audio
        assert turn.transcript == audio.transcript
        assert len(turn.pcm) and turn.pcm == base64.b64decode(audio.data)

        # Every stage lets the cancelled request go (its own count of what it holds).
        for stage in ("thinker", "speaker"):

            async def let_go(name: str = stage) -> bool:
                return await metered.holding(name) == 0

            await eventually(let_go, 30, message=f"{stage} still holds the cancelled request")
        assert speaking.server.router.in_flight == 0
        # Nothing of the cancelled response came after its response.done: the next
        # events of this session answer the next client event.
        await connection.conversation.item.retrieve(item_id=item["id"])
        after = await until(connection, "conversation.item.retrieved")
        assert not [e for e in after if e["type"].startswith("response.")], after
        # The conversation keeps what was said before the cancel, and goes on.
        assert after[-1]["item"]["status"] == "incomplete"
        await connection.conversation.item.create(item=user_text("Thank you."))
        await until(connection, "conversation.item.done")
        turn = await respond(connection, max_output_tokens=8)
        assert turn.status == "incomplete" and turn.pcm
