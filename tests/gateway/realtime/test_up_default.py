"""/v1/realtime on the default pipeline as `omni up --http` runs it (SmolLM2
thinker, diffusion renderer, hibari speaker): a text item is answered in audio
equal to the chat completion's for the same messages and parameters, through the
official Python SDK and the `openai` npm package's realtime client alike; and
`omni up --max-sessions` reaches the gateway."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json

import pytest
import websockets
from openai import OpenAI

from tests.helpers.node import node_client
from tests.helpers.realtime import Turn, respond, sdk, until, user_text

MODEL = "omni-default"
PROMPT = "Say one short sentence about the moon."


@pytest.fixture(scope="module")
async def turn(default: str) -> Turn:
    async with sdk(default).realtime.connect(model=MODEL) as connection:
        await until(connection, "session.created")
        await connection.conversation.item.create(item=user_text(PROMPT))
        await until(connection, "conversation.item.done")
        return await respond(connection, max_output_tokens=16)


async def test_text_in_audio_out_equals_the_chat_completion(default: str, turn: Turn) -> None:
    client = OpenAI(base_url=default, api_key="x", max_retries=0, timeout=300)
    expected = await asyncio.to_thread(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
            max_tokens=16,
        )
    )
    audio = expected.choices[0].message.audio
    assert turn.transcript == audio.transcript and turn.transcript
    assert turn.pcm == base64.b64decode(audio.data) and turn.pcm


async def test_a_node_client_on_the_openai_package_gets_the_same_turn(
    default: str, turn: Turn
) -> None:
    script = node_client("ws") / "realtime.mjs"
    process = await asyncio.create_subprocess_exec(
        "node", str(script), "--json", "--base-url", default, "--model", MODEL,
        "--max-tokens", "16", PROMPT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, (out.decode(), err.decode())
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["status"] == turn.status
    assert result["transcript"] == turn.transcript
    assert result["audio_sha256"] == hashlib.sha256(turn.pcm).hexdigest()


async def test_omni_up_max_sessions_reaches_the_gateway(default: str) -> None:
    url = default.replace("http://", "ws://") + f"/realtime?model={MODEL}"
    headers = {"Authorization": "Bearer x"}
    opened = [await websockets.connect(url, additional_headers=headers) for _ in range(3)]
    try:
        for ws in opened:
            assert json.loads(await ws.recv())["type"] == "session.created"
        async with websockets.connect(url, additional_headers=headers) as fourth:
            refused = json.loads(await fourth.recv())
            assert refused["error"]["code"] == "session_limit_reached"
            with pytest.raises(websockets.ConnectionClosed):
                await fourth.recv()
            assert fourth.close_code == 1013
    finally:
        for ws in opened:
            await ws.close()
