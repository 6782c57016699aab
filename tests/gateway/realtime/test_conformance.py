"""What voice-agent frameworks ask of /v1/realtime at their defaults, through the
official SDK against a real gateway over a real thinker and speaker: an OpenAI
realtime model name is served and an unknown one refused at the handshake; a
framework's first session.update (semantic VAD, input transcription, noise
reduction, tracing and one field the mesh lacks) keeps its instructions, which
reach the mesh; and a truncated answer is remembered as what was heard."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets
from openai import OpenAI

from tests.gateway.conftest import MODEL, Mesh
from tests.helpers.realtime import respond, sdk, until, user_text

PROMPT = "Name three colours."
INSTRUCTIONS = "You are a pirate. Always answer like a pirate, saying 'Arr' first."
# What openai-agents, Pipecat and LiveKit send first at their defaults (as probed).
FRAMEWORK_UPDATE = {
    "type": "realtime",
    "model": "gpt-realtime-2.1",
    "output_modalities": ["audio"],
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": 24000},
            "turn_detection": {"type": "semantic_vad", "eagerness": "high"},
            "transcription": {"model": "gpt-4o-mini-transcribe"},
            "noise_reduction": {"type": "near_field"},
        },
        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"},
    },
    "tracing": "auto",
}


def spoken_chat(mesh: Mesh, messages: list[dict[str, Any]], max_tokens: int) -> str:
    """The transcript a chat completion speaks for ``messages``."""
    client = OpenAI(base_url=mesh.base_url, api_key="x", max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        max_tokens=max_tokens,
    )
    audio = answer.choices[0].message.audio
    assert audio is not None
    return str(audio.transcript)


async def test_a_realtime_model_name_is_served_and_an_unknown_one_refused_at_the_handshake(
    speaking: Mesh,
) -> None:
    async with sdk(speaking.base_url).realtime.connect(model="gpt-realtime-2.1") as connection:
        created = (await until(connection, "session.created"))[-1]["session"]
        assert created["model"] == "gpt-realtime-2.1"
        await connection.conversation.item.create(item=user_text(PROMPT))
        await until(connection, "conversation.item.done")
        turn = await respond(connection, max_output_tokens=4)
        assert turn.status == "incomplete" and turn.pcm
    url = speaking.base_url.replace("http://", "ws://") + "/realtime?model=gpt-4o"
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(url, additional_headers={"Authorization": "Bearer x"})
    response = refused.value.response
    assert response.status_code == 404  # refused before the WebSocket opened: no retry loop
    error = json.loads(response.body or b"{}")["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")


async def test_a_framework_update_keeps_its_instructions_and_names_what_it_cannot_serve(
    speaking: Mesh,
) -> None:
    user = {"role": "user", "content": PROMPT}
    plain, instructed = await asyncio.gather(
        asyncio.to_thread(spoken_chat, speaking, [user], 12),
        asyncio.to_thread(
            spoken_chat, speaking, [{"role": "system", "content": INSTRUCTIONS}, user], 12
        ),
    )
    assert plain != instructed  # else this test could not tell the instructions were lost
    async with sdk(speaking.base_url).realtime.connect(model="gpt-realtime") as connection:
        await until(connection, "session.created")
        update = {**FRAMEWORK_UPDATE, "instructions": INSTRUCTIONS, "temperature": 0.7}
        await connection.send_raw(
            json.dumps({"type": "session.update", "event_id": "u1", "session": update})
        )
        seen = await until(connection, "error")
        assert [e["type"] for e in seen] == ["session.updated", "error"]
        session, error = seen[0]["session"], seen[1]["error"]
        assert session["instructions"] == INSTRUCTIONS
        detection = session["audio"]["input"]["turn_detection"]
        assert detection["type"] == "semantic_vad" and detection["silence_duration_ms"] == 250
        assert session["audio"]["input"]["transcription"]["model"] == "gpt-4o-mini-transcribe"
        assert session["audio"]["input"]["noise_reduction"]["type"] == "near_field"
        assert session["tracing"] == "auto"
        assert (error["param"], error["event_id"]) == ("session.temperature", "u1")
        assert "the other fields were applied" in error["message"]
        await connection.conversation.item.create(item=user_text(PROMPT))
        await until(connection, "conversation.item.done")
        turn = await respond(connection, max_output_tokens=12)
    assert turn.transcript == instructed


async def test_a_truncated_answer_is_remembered_as_what_was_heard(speaking: Mesh) -> None:
    async with sdk(speaking.base_url).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        await connection.conversation.item.create(item=user_text(PROMPT))
        await until(connection, "conversation.item.done")
        first = await respond(connection, max_output_tokens=24)
        assert first.done is not None
        item_id = first.done["output"][0]["id"]
        played_ms = len(first.pcm) * 1000 // 48000
        await connection.conversation.item.truncate(
            item_id=item_id, content_index=0, audio_end_ms=played_ms // 2
        )
        truncated = (await until(connection, "conversation.item.truncated"))[-1]
        assert truncated["audio_end_ms"] == played_ms // 2
        await connection.conversation.item.retrieve(item_id=item_id)
        heard = (await until(connection, "conversation.item.retrieved"))[-1]["item"]
        cut = heard["content"][0]["transcript"]
        words, said = len(cut.split()), len(first.transcript.split())
        assert first.transcript.startswith(cut) and said // 2 - 1 <= words <= said // 2 + 1
        # The next turn sends the mesh the answer as it was heard.
        await connection.conversation.item.create(item=user_text("Go on."))
        await until(connection, "conversation.item.done")
        second = await respond(connection, max_output_tokens=8)
    expected = await asyncio.to_thread(
        spoken_chat,
        speaking,
        [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": cut},
            {"role": "user", "content": "Go on."},
        ],
        8,
    )
    assert second.transcript == expected
