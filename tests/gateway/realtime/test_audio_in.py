"""Audio in, on the tiny Qwen3-Omni pipeline as `omni up --http` runs it (its
thinker takes audio): committed input audio is answered with the text and audio
a chat completion gets for the same clip as ``input_audio``; under server VAD
(Silero) the session hears where speech starts and stops, commits the turn and
answers it by itself, and speech that starts while it answers cancels the answer."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hibari import Hibari
from openai import OpenAI

from services.mesh import wav
from tests.gateway.realtime.conftest import omni_up
from tests.helpers.realtime import read_turn, respond, sdk, until, user_text

MODEL = "qwen3-omni"
RATE = 24000


@pytest.fixture(scope="module")
async def qwen(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path
) -> AsyncIterator[str]:
    folder = tmp_path_factory.mktemp("qwen-up")
    async with omni_up("examples/pipelines/qwen3-omni.yaml", folder, omni_cache_dir) as base_url:
        yield base_url


def speech(text: str) -> bytes:
    """hibari saying ``text``: 16-bit PCM at 24 kHz."""
    return wav.pcm16(Hibari()(text, seed=0))


def silence(seconds: float) -> bytes:
    return bytes(int(RATE * seconds) * 2)


def chunks(pcm: bytes, ms: int = 100) -> list[bytes]:
    step = RATE * 2 * ms // 1000
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


async def test_committed_audio_is_answered_as_a_chat_completion_answers_the_clip(qwen: str) -> None:
    pcm = speech("What is the weather like today?")
    clip = base64.b64encode(wav.header(RATE, 1, len(pcm)) + pcm).decode()
    client = OpenAI(base_url=qwen, api_key="x", max_retries=0, timeout=120)
    expected = await asyncio.to_thread(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}
                    ],
                }
            ],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
        )
    )
    audio = expected.choices[0].message.audio
    async with sdk(qwen).realtime.connect(model=MODEL) as connection:
        created = (await until(connection, "session.created"))[-1]["session"]
        # A pipeline that hears starts with server VAD on, as OpenAI's sessions do.
        assert created["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        await connection.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        await until(connection, "session.updated")
        for piece in chunks(pcm):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        await connection.input_audio_buffer.commit()
        committed = await until(connection, "conversation.item.done")
        kinds = [e["type"] for e in committed]
        assert kinds == [
            "input_audio_buffer.committed",
            "conversation.item.added",
            "conversation.item.done",
        ]
        assert committed[-1]["item"]["content"][0]["type"] == "input_audio"
        turn = await respond(connection)
    assert turn.status in ("completed", "incomplete"), turn.done
    assert turn.transcript == audio.transcript and turn.transcript
    assert turn.pcm == base64.b64decode(audio.data) and turn.pcm
    assert turn.done is not None
    assert turn.done["usage"]["input_tokens"] == expected.usage.prompt_tokens


async def test_server_vad_hears_a_turn_and_answers_it(qwen: str) -> None:
    said = speech("Hello there, how are you doing today?")
    stream = silence(0.6) + said + silence(1.2)
    async with sdk(qwen).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        vad = {"type": "server_vad", "silence_duration_ms": 500, "prefix_padding_ms": 300}
        await connection.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": vad}}}
        )
        updated = (await until(connection, "session.updated"))[-1]["session"]
        assert updated["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        for piece in chunks(stream):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        heard = await until(connection, "response.created")
        turn = await read_turn(connection)
    kinds = [e["type"] for e in heard]
    assert kinds[:5] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ], kinds
    started, stopped, committed = heard[0], heard[1], heard[2]
    assert 500 <= started["audio_start_ms"] <= 1400  # hibari's clip starts at 600 ms
    speech_end_ms = 600 + len(said) * 1000 // (RATE * 2)
    assert speech_end_ms <= stopped["audio_end_ms"] <= speech_end_ms + 1200
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    assert turn.status in ("completed", "incomplete") and turn.pcm


async def test_speech_starting_under_server_vad_cancels_the_answer(qwen: str) -> None:
    async with sdk(qwen).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        vad = {"type": "server_vad", "create_response": False, "interrupt_response": True}
        await connection.session.update(
            session={"type": "realtime", "max_output_tokens": 2000,
                     "audio": {"input": {"turn_detection": vad}}}
        )  # fmt: skip
        await until(connection, "session.updated")
        await connection.conversation.item.create(item=user_text("Tell me a very long story."))
        await until(connection, "conversation.item.done")
        await connection.response.create()
        await until(connection, "response.output_audio_transcript.delta")
        talk = speech("Wait, stop, I have a question about that.")
        await connection.input_audio_buffer.append(audio=base64.b64encode(talk).decode())
        seen = await until(connection, "response.done")
    kinds = [e["type"] for e in seen]
    assert "input_audio_buffer.speech_started" in kinds
    done = seen[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    after = kinds.index("response.done")
    assert "response.output_audio.delta" not in kinds[after:]
