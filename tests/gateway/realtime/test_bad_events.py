"""Hostile and mistaken client events: each is answered with an ``error`` naming
its field (and echoing its event_id), changes nothing, and the session then
answers a good request as if nothing had happened."""

from __future__ import annotations

import base64
import json
from typing import Any

from tests.gateway.conftest import MODEL, Mesh
from tests.gateway.realtime.conftest import LIMITS
from tests.helpers.realtime import respond, sdk, until, user_text

BUFFER_LIMIT = int(LIMITS["--max-audio-buffer-bytes"])
SILENCE = base64.b64encode(bytes(4800)).decode()  # 100 ms at 24 kHz


def _update(session: dict[str, Any]) -> dict[str, Any]:
    return {"type": "session.update", "session": {"type": "realtime", **session}}


def _item(item: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "conversation.item.create", "item": item, **extra}


def _part(part: dict[str, Any], role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [part]}


BAD: list[tuple[Any, str]] = [
    ({"type": "response.create"}, "type"),  # no item and no instructions: nothing to answer
    ({"type": "response.speak"}, "type"),
    ({"type": "output_audio_buffer.clear"}, "type"),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"odd").decode()}, "audio"),
    ({"type": "input_audio_buffer.append"}, "audio"),
    (
        {
            "type": "input_audio_buffer.append",
            "audio": base64.b64encode(bytes(BUFFER_LIMIT + 2)).decode(),
        },
        "audio",
    ),
    (
        _update({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}),
        "session.audio.output.format.type",
    ),
    (
        _update({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}),
        "session.audio.input.format.rate",
    ),
    (
        _update({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": 1}}}}),
        "session.audio.input.turn_detection.eagerness",
    ),
    (
        _update({"audio": {"input": {"turn_detection": {"type": "speech_vad"}}}}),
        "session.audio.input.turn_detection",
    ),
    (_update({"tools": [{"type": "function", "name": "f"}]}), "session.tools"),
    (_update({"output_modalities": ["video"]}), "session.output_modalities[0]"),
    (_update({"temperature": 0.5}), "session.temperature"),
    (_update({"model": "gpt-4o"}), "session.model"),
    (_update({"max_output_tokens": 0}), "session.max_output_tokens"),
    (_item({"type": "function_call", "name": "f", "arguments": "{}"}), "item.type"),
    (_item(_part({"type": "output_text", "text": "hi"})), "item.content[0].type"),
    (
        _item(_part({"type": "input_text", "text": "hi"}), previous_item_id="nope"),
        "previous_item_id",
    ),
    (_item(_part({"type": "input_audio", "audio": SILENCE})), "item.content[0]"),
    (
        {"type": "response.create", "response": {"max_output_tokens": 0}},
        "response.max_output_tokens",
    ),
    (
        {"type": "response.create", "response": {"output_modalities": ["audio", "text"]}},
        "response.output_modalities",
    ),
    ({"type": "response.cancel"}, "type"),
    ({"type": "conversation.item.retrieve", "item_id": "item_nope"}, "item_id"),
]


async def _refused(connection: Any, event: Any, param: str, n: int) -> dict[str, Any]:
    if isinstance(event, dict):
        event = {**event, "event_id": f"bad_{n}"}
    await connection.send_raw(event if isinstance(event, str) else json.dumps(event))
    seen = await until(connection, "error")
    error = seen[-1]["error"]
    assert error["param"] == param, (event, error)
    assert error["type"] == "invalid_request_error"
    if isinstance(event, dict):
        assert error["event_id"] == f"bad_{n}", error
    return error


async def test_bad_events_are_answered_by_name_and_the_session_goes_on(speaking: Mesh) -> None:
    async with sdk(speaking.base_url).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        for n, (event, param) in enumerate(BAD):
            await _refused(connection, event, param, n)
        await connection.send_raw("{not json")
        error = (await until(connection, "error"))[-1]["error"]
        assert error["code"] == "invalid_json"

        # A committed buffer on a pipeline whose entry stage takes text only: the
        # field, and the kinds the stage accepts.
        await connection.send_raw(
            json.dumps({"type": "input_audio_buffer.append", "audio": SILENCE})
        )
        await connection.send_raw(json.dumps({"type": "input_audio_buffer.commit"}))
        error = (await until(connection, "error"))[-1]["error"]
        assert error["param"] == "input_audio_buffer", error
        assert "'thinker' accepts text, not audio" in error["message"]

        # A response asked for while one is in progress.
        await connection.conversation.item.create(item=user_text("Tell me a long story."))
        await until(connection, "conversation.item.done")
        await connection.response.create(response={"max_output_tokens": 200})
        await connection.send_raw(json.dumps({"type": "response.create", "event_id": "again"}))
        seen = await until(connection, "error")
        error = seen[-1]["error"]
        assert (error["param"], error["event_id"]) == ("type", "again")
        assert error["code"] == "conversation_already_has_active_response"
        await connection.response.cancel()
        assert (await until(connection, "response.done"))[-1]["response"]["status"] == "cancelled"

        # A voice the stage lacks: the stage refuses it, named as the session's field.
        await connection.session.update(
            session={"type": "realtime", "audio": {"output": {"voice": "nope"}}}
        )
        await until(connection, "session.updated")
        await connection.response.create()
        turn_events = await until(connection, "response.done")
        (error_event,) = [e for e in turn_events if e["type"] == "error"]
        assert error_event["error"]["param"] == "session.audio.output.voice", error_event
        assert "unknown voice 'nope'" in error_event["error"]["message"]
        assert turn_events[-1]["response"]["status"] == "failed"

        # Nothing of the above stuck: a good request is answered.
        await connection.session.update(
            session={"type": "realtime", "audio": {"output": {"voice": "alloy"}}}
        )
        await until(connection, "session.updated")
        turn = await respond(connection, max_output_tokens=8)
        assert turn.status == "incomplete" and turn.pcm and turn.transcript
