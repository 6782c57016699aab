"""Realtime turns through the official SDK's ``client.realtime.connect`` against a
real gateway over a real thinker and speaker: a text item answered in audio is
the audio and transcript a chat completion gets for the same messages, and a
session is a conversation: each response sends the mesh every turn before it."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from openai import OpenAI

from tests.gateway.conftest import MODEL, Mesh
from tests.helpers.realtime import respond, sdk, until, user_text

PROMPT = "Say two short sentences about the sea."


def chat(mesh: Mesh, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    client = OpenAI(base_url=mesh.base_url, api_key="x", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        max_tokens=max_tokens,
    )


async def test_a_text_item_is_answered_in_audio_as_chat_completions_answer_it(
    speaking: Mesh,
) -> None:
    expected = await asyncio.to_thread(chat, speaking, [{"role": "user", "content": PROMPT}], 24)
    audio = expected.choices[0].message.audio
    async with sdk(speaking.base_url).realtime.connect(model=MODEL) as connection:
        created = await until(connection, "session.created")
        session = created[-1]["session"]
        assert session["output_modalities"] == ["audio"]
        assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
        await connection.session.update(session={"type": "realtime", "max_output_tokens": 24})
        updated = (await until(connection, "session.updated"))[-1]["session"]
        assert updated["max_output_tokens"] == 24 and updated["conversation_budget"]["max_items"]
        await connection.conversation.item.create(item=user_text(PROMPT))
        added = await until(connection, "conversation.item.done")
        assert [e["type"] for e in added] == ["conversation.item.added", "conversation.item.done"]
        turn = await respond(connection)
    # 24 tokens end it, as they end the chat completion ("length"): incomplete, and why.
    assert expected.choices[0].finish_reason == "length"
    assert turn.status == "incomplete", turn.done
    assert turn.done is not None
    assert set(speaking.server.router.recent_bytes[turn.done["id"]]) == {"thinker", "speaker"}
    details = turn.done["status_details"]
    assert (details["type"], details["reason"]) == ("incomplete", "max_output_tokens")
    assert turn.transcript == audio.transcript
    assert turn.pcm == base64.b64decode(audio.data)
    assert len(turn.of("response.output_audio.delta")) >= 2  # as it is spoken, not at the end
    kinds = [e["type"] for e in turn.events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.done"
    assert kinds.index("response.output_audio.done") > max(
        i for i, k in enumerate(kinds) if k == "response.output_audio.delta"
    )
    (transcript_done,) = turn.of("response.output_audio_transcript.done")
    assert transcript_done["transcript"] == audio.transcript
    usage = turn.done["usage"]
    assert usage["output_tokens"] == expected.usage.completion_tokens
    assert usage["input_tokens"] == expected.usage.prompt_tokens


async def test_three_turns_the_third_response_sees_the_first_two(speaking: Mesh) -> None:
    """Each response sends the whole conversation: the third answer is the chat
    completion of all five messages (greedy), on the prompt the thinker counted
    for them, and not the answer to its question alone."""
    questions = ["My name is Ada. Say hello.", "What is two plus two?", "What is my name?"]
    history: list[dict[str, Any]] = []
    counted = []
    async with sdk(speaking.base_url).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        text_only = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 12}
        await connection.session.update(session=text_only)
        await until(connection, "session.updated")
        for question in questions:
            await connection.conversation.item.create(item=user_text(question))
            await until(connection, "conversation.item.done")
            turn = await respond(connection)
            assert turn.text and not turn.pcm, turn.events[-1]
            assert turn.done is not None
            # Text alone: the speaker does not run (the gateway names its outputs).
            assert set(speaking.server.router.recent_bytes[turn.done["id"]]) == {"thinker"}
            counted.append(turn.done["usage"]["input_tokens"])
            history += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": turn.text},
            ]
    client = OpenAI(base_url=speaking.base_url, api_key="x", max_retries=0, timeout=120)

    def answer(messages: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)  # type: ignore[arg-type]

    whole = await asyncio.to_thread(answer, history[:5])
    alone = await asyncio.to_thread(answer, history[4:5])
    assert history[5]["content"] == whole.choices[0].message.content
    assert counted[2] == whole.usage.prompt_tokens  # the thinker's prompt: all five messages
    assert counted[2] > alone.usage.prompt_tokens + counted[0]
    assert counted[0] < counted[1] < counted[2]


async def test_with_instructions_and_no_item_the_model_speaks_first(speaking: Mesh) -> None:
    """A voice agent's greeting (Pipecat asks for one): ``response.create`` on an empty
    conversation answers the instructions alone, as a chat completion of the system
    message alone does."""
    instructions = "Greet the user in one short sentence."
    async with sdk(speaking.base_url).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        update = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 12}
        await connection.session.update(session={**update, "instructions": instructions})
        await until(connection, "session.updated")
        turn = await respond(connection)
    client = OpenAI(base_url=speaking.base_url, api_key="x", max_retries=0, timeout=120)
    expected = await asyncio.to_thread(
        client.chat.completions.create,
        model=MODEL,
        messages=[{"role": "system", "content": instructions}],
        max_tokens=12,
    )
    assert turn.done is not None and turn.text, turn.events[-1]
    assert turn.text == expected.choices[0].message.content
    assert turn.done["usage"]["input_tokens"] == expected.usage.prompt_tokens
