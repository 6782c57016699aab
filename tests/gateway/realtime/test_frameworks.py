"""The voice-agent frameworks' own realtime clients, at their defaults, against
the default pipeline as `omni up --http` runs it: the OpenAI Agents SDK
(RealtimeAgent/RealtimeRunner), Pipecat (OpenAIRealtimeLLMService) and LiveKit
Agents (openai.realtime.RealtimeModel). Each completes a text turn without an
error, and its agent's instructions reach the thinker: the answer is the one a
chat completion gets for the same system and user messages in this run. Each
also completes a spoken turn: our speaker's speech streamed in at the pace of
speech, heard by the recogniser (the words within a WER bound) and answered.

The frameworks pin other versions than the mesh (LiveKit's protobuf is older),
so they live in a virtual environment of their own, `.venv-voice`
(`.ci/voice-env.sh`); each turn is a script of tests/gateway/frameworks run with
its Python. Without that environment these tests are skipped, saying so."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hibari import Hibari
from openai import OpenAI

from services.mesh import wav
from tests.engines.whisper.wer import wer

REPO = Path(__file__).resolve().parents[3]
VOICE_PYTHON = Path(os.environ.get("OMNI_VOICE_VENV", REPO / ".venv-voice")) / "bin" / "python"
SCRIPTS = REPO / "tests" / "gateway" / "frameworks"
INSTRUCTIONS = "You are a pirate. Always answer like a pirate."
PROMPT = "Name three colours."
MAX_WER = 0.2

pytestmark = pytest.mark.skipif(
    not VOICE_PYTHON.exists(),
    reason=f"no voice-framework environment at {VOICE_PYTHON.parent.parent} (.ci/voice-env.sh)",
)


async def run_turn(script: str, base_url: str, *args: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        str(VOICE_PYTHON), str(SCRIPTS / script), base_url, *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), 240)
    finally:  # a turn that hangs (or a test that times out) leaves no client behind
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()[-3000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def chat(base_url: str, messages: list[dict[str, str]]) -> str:
    client = OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    answer = client.chat.completions.create(model="omni-default", messages=messages)  # type: ignore[arg-type]
    return str(answer.choices[0].message.content)


@pytest.fixture(scope="module")
async def expected(default: str) -> str:
    system = {"role": "system", "content": INSTRUCTIONS}
    return await asyncio.to_thread(chat, default, [system, {"role": "user", "content": PROMPT}])


@pytest.mark.parametrize("script", ["agents_turn.py", "pipecat_turn.py", "livekit_turn.py"])
async def test_a_text_turn_at_the_frameworks_defaults(
    default: str, expected: str, script: str
) -> None:
    result = await run_turn(script, default, INSTRUCTIONS, PROMPT)
    assert result["errors"] == [], result
    assert result["text"].strip() == expected.strip(), result
    if "audio_bytes" in result:
        assert result["audio_bytes"] > 0, result


@pytest.mark.parametrize("script", ["agents_turn.py", "pipecat_turn.py", "livekit_turn.py"])
async def test_a_spoken_turn_at_the_frameworks_defaults(
    default: str, script: str, tmp_path: Path
) -> None:
    question = "What is the capital of France?"
    pcm = wav.pcm16(Hibari()(question, seed=0))
    clip = tmp_path / "q.wav"
    clip.write_bytes(wav.header(24000, 1, len(pcm)) + pcm)
    result = await run_turn(script, default, INSTRUCTIONS, "", str(clip))
    assert result["errors"] == [], result
    assert wer(question, result["heard"]) <= MAX_WER, result
    assert result["text"], result
    if "audio_bytes" in result:  # LiveKit without a room has no audio output
        assert result["audio_bytes"] > 0, result
