"""Speech in on the default pipeline as `omni up --http` runs it (SmolLM2
thinker, renderer, hibari speaker, Whisper tiny.en recogniser), offline. Speech
is our own speaker's (hibari), so what it says is known: the recogniser must
give the words back (a word error rate bound), and a spoken question must be
answered as the same question typed is answered in the same run (the typed
question being what the recogniser heard). Through /v1/audio/transcriptions
(the SDK's audio.transcriptions.create), a chat completion's input_audio, and a
realtime session (server VAD on from the start, input transcription events)."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import numpy as np
from hibari import Hibari
from openai import OpenAI

from services.mesh import wav
from tests.engines.whisper.wer import wer
from tests.helpers.realtime import read_turn, sdk, until, user_audio

MODEL = "omni-default"
RATE = 24000
QUESTION = "What is the capital of France?"
MAX_WER = 0.2  # tiny.en on clean synthetic speech: a bound, not an answer


def speech(text: str) -> bytes:
    return wav.pcm16(Hibari()(text, seed=0))


def as_wav(pcm: bytes) -> bytes:
    return wav.header(RATE, 1, len(pcm)) + pcm


def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)


def transcribe(base_url: str, clip: bytes, **options: Any) -> Any:
    return client(base_url).audio.transcriptions.create(
        model="whisper-1", file=("q.wav", io.BytesIO(clip), "audio/wav"), **options
    )


def answer(base_url: str, content: Any) -> str:
    reply = client(base_url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
    )
    return str(reply.choices[0].message.content)


async def test_transcriptions_give_back_the_words_in_each_format(default: str) -> None:
    clip = as_wav(speech(QUESTION))
    plain, text, verbose = await asyncio.gather(
        asyncio.to_thread(transcribe, default, clip),
        asyncio.to_thread(transcribe, default, clip, response_format="text"),
        asyncio.to_thread(transcribe, default, clip, response_format="verbose_json"),
    )
    assert wer(QUESTION, plain.text) <= MAX_WER, plain.text
    assert text.strip() == plain.text and verbose.text == plain.text
    assert verbose.duration >= 1 and verbose.language


async def test_a_spoken_question_is_answered_as_the_typed_one(default: str) -> None:
    clip = as_wav(speech(QUESTION))
    heard = (await asyncio.to_thread(transcribe, default, clip)).text
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(),
                                                    "format": "wav"}}  # fmt: skip
    spoken, typed = await asyncio.gather(
        asyncio.to_thread(answer, default, [part]), asyncio.to_thread(answer, default, heard)
    )
    assert spoken == typed and spoken


async def test_a_realtime_spoken_turn_is_heard_transcribed_and_answered(default: str) -> None:
    said = speech(QUESTION)
    stream = bytes(RATE * 2 // 2) + said + bytes(RATE * 2 * 3 // 2)  # 0.5 s, speech, 1.5 s
    async with sdk(default).realtime.connect(model="gpt-realtime") as connection:
        created = (await until(connection, "session.created"))[-1]["session"]
        assert created["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        await connection.session.update(
            session={
                "type": "realtime",
                "max_output_tokens": 12,
                "audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe"}}},
            }
        )
        await until(connection, "session.updated")
        step = RATE * 2 // 10
        for i in range(0, len(stream), step):
            chunk = base64.b64encode(stream[i : i + step]).decode()
            await connection.input_audio_buffer.append(audio=chunk)
        heard = await until(connection, "response.created")
        turn = await read_turn(connection)
    kinds = [e["type"] for e in heard + turn.events]
    assert kinds[:3] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
    ], kinds
    done = [e for e in heard + turn.events if e["type"].endswith("transcription.completed")]
    deltas = [e for e in heard + turn.events if e["type"].endswith("transcription.delta")]
    assert len(done) == 1 and wer(QUESTION, done[0]["transcript"]) <= MAX_WER, kinds
    assert "".join(d["delta"] for d in deltas).strip() == done[0]["transcript"]
    assert turn.status in ("completed", "incomplete") and turn.pcm
    # The answer is the one the transcript gets typed (the thinker saw text).
    typed = await asyncio.to_thread(answer, default, done[0]["transcript"])
    assert turn.transcript == typed


def _trimmed(pcm: bytes) -> bytes:
    """Speech without its quiet head and tail (hibari pads both)."""
    loud = np.flatnonzero(np.abs(np.frombuffer(pcm, "<i2")) > 600)
    return pcm[2 * loud[0] : 2 * loud[-1] + 2]


async def test_a_pause_mid_question_is_one_turn_heard_whole(default: str) -> None:
    """350 ms of quiet mid-question: long enough for the session to start hearing
    the turn early (vad.PAUSE_MS), too short to end it (the 500 ms window). The
    speech after the pause must drop that early guess: the turn is heard whole."""
    halves = _trimmed(speech("What is the capital")), _trimmed(speech("of France?"))
    quiet = bytes(RATE * 2 * 350 // 1000)
    stream = bytes(RATE) + halves[0] + quiet + halves[1] + bytes(RATE * 3)
    async with sdk(default).realtime.connect(model="gpt-realtime") as connection:
        await until(connection, "session.created")
        transcription = {"transcription": {"model": "gpt-4o-mini-transcribe"}}
        await connection.session.update(
            session={"type": "realtime", "max_output_tokens": 4, "audio": {"input": transcription}}
        )
        await until(connection, "session.updated")
        step = RATE * 2 // 10
        for i in range(0, len(stream), step):
            chunk = base64.b64encode(stream[i : i + step]).decode()
            await connection.input_audio_buffer.append(audio=chunk)
        heard = await until(connection, "conversation.item.input_audio_transcription.completed")
    kinds = [e["type"] for e in heard]
    assert kinds.count("input_audio_buffer.speech_started") == 1, kinds
    assert kinds.count("input_audio_buffer.committed") == 1, kinds
    assert wer(QUESTION, heard[-1]["transcript"]) <= MAX_WER, heard[-1]


async def test_silence_committed_by_hand_fails_its_transcription_by_name(default: str) -> None:
    async with sdk(default).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        await connection.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}
                },
            }
        )
        await until(connection, "session.updated")
        await connection.input_audio_buffer.append(audio=base64.b64encode(bytes(9600)).decode())
        await connection.input_audio_buffer.commit()
        failed = (await until(connection, "conversation.item.input_audio_transcription.failed"))[-1]
    assert failed["error"]["param"] == "item.content[0].audio", failed
    assert "silent" in failed["error"]["message"]


async def test_an_audio_item_created_by_the_client_is_heard_too(default: str) -> None:
    async with sdk(default).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        await connection.session.update(
            session={
                "type": "realtime",
                "max_output_tokens": 8,
                "audio": {"input": {"transcription": {"model": "whisper-1"}}},
            }
        )
        await until(connection, "session.updated")
        await connection.conversation.item.create(item=user_audio(speech(QUESTION)))
        done = await until(connection, "conversation.item.input_audio_transcription.completed")
        assert wer(QUESTION, done[-1]["transcript"]) <= MAX_WER, done[-1]
        await connection.conversation.item.retrieve(item_id=done[-1]["item_id"])
        item = (await until(connection, "conversation.item.retrieved"))[-1]["item"]
        assert item["content"][0]["transcript"] == done[-1]["transcript"]
