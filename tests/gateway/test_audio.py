"""Audio out through a real gateway over a real thinker and a real hibari speaker
(stage processes, the packaged voice): /v1/audio/speech runs the speaker alone
and answers hibari's own audio of the text, WAV or streamed PCM; a chat with
``modalities: ["text", "audio"]`` answers OpenAI's ``message.audio`` (or, when
streamed, ``delta.audio`` pieces) holding the audio the gRPC client gets for the
same request. What the pipeline cannot do is refused with 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from hibari import Hibari
from openai import AsyncOpenAI, OpenAI

from services.mesh import wav
from services.mesh.pb.omni.v1 import stage_pb2
from services.testing.configs import stage_config
from tests.engines.speech.conftest import speaker_config
from tests.gateway.conftest import MODEL, Mesh, mesh_over
from tests.orchestrator.conftest import Stages

EDGE = {"from": "thinker", "to": "speaker", "window": 4, "first_window": 2, "transform": "tokens"}
TEXT = "The sea is calm tonight. A gull flies over the harbour."
PROMPT = "Say two short sentences about the sea."
GREEDY = {"max_tokens": 24, "temperature": 0.0, "seed": 0}


@pytest.fixture(scope="module")
async def stages(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Stages]:
    stages = Stages(tmp_path_factory.mktemp("speaking"))
    thinker = stage_config(
        "thinker",
        omni_cache_dir,
        segmenting={"max_segment_tokens": 4, "min_flush_interval_ms": 50},
        runtime={"torch_threads": 1},
    )
    try:
        await stages.start({"thinker": thinker, "speaker": speaker_config(str(omni_cache_dir))})
        yield stages
    finally:
        await stages.stop()


@pytest.fixture(scope="module")
async def speaking(stages: Stages) -> AsyncIterator[Mesh]:
    """As the speech pipeline: the thinker's text and the speaker's audio reach clients."""
    outputs = ["thinker", "speaker"]
    async with mesh_over(stages, stages.folder, edges=[EDGE], outputs=outputs) as mesh:
        yield mesh


def spoken(text: str, speed: float = 1.0) -> bytes:
    """hibari's own audio of ``text`` as the stage speaks it (sentence by sentence,
    seed 0), as 16-bit PCM."""
    tts = Hibari()
    audio = [tts(s, speed=speed, seed=0) for s in Hibari.split_sentences(text)]
    return wav.pcm16(np.concatenate(audio))


def read_wav(data: bytes) -> tuple[wave._wave_params, bytes]:
    with wave.open(io.BytesIO(data)) as w:
        return w.getparams(), w.readframes(w.getnframes())


def sdk(mesh: Mesh) -> OpenAI:
    return OpenAI(base_url=mesh.base_url, api_key="x", max_retries=0, timeout=120)


def async_sdk(mesh: Mesh) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=mesh.base_url, api_key="x", max_retries=0, timeout=120)


async def test_speech_is_hibaris_audio_of_the_input_as_a_wav(speaking: Mesh) -> None:
    reply = await asyncio.to_thread(
        lambda: sdk(speaking).audio.speech.create(
            model=MODEL, input=TEXT, voice="heart", response_format="wav", speed=1.25
        )
    )
    assert reply.response.headers["content-type"] == "audio/wav"
    params, pcm = read_wav(reply.content)
    assert (params.framerate, params.nchannels, params.sampwidth) == (24000, 1, 2)
    assert pcm == spoken(TEXT, speed=1.25)  # the speaker alone: the text, not a thinker's answer


async def test_speech_streams_pcm_as_it_is_spoken(speaking: Mesh) -> None:
    pieces = []
    client = async_sdk(speaking)
    async with client.audio.speech.with_streaming_response.create(
        model=MODEL, input=TEXT, voice="heart", response_format="pcm"
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        async for piece in response.iter_bytes():
            pieces.append(piece)
    assert b"".join(pieces) == spoken(TEXT)


async def _grpc_speech(mesh: Mesh) -> tuple[str, bytes]:
    """The thinker's answer and the speaker's audio (16-bit PCM) for PROMPT, as the
    gRPC client gets them."""
    result = await mesh.client.generate(PROMPT, params=GREEDY).collect()
    assert result.ok, result.done
    samples = [np.frombuffer(t.raw, "<f4") for t in result.stages["speaker"].tensors["audio"]]
    return result.stages["thinker"].text, wav.pcm16(np.concatenate(samples))


async def test_chat_answers_message_audio_as_the_grpc_client_hears_it(speaking: Mesh) -> None:
    text, pcm = await _grpc_speech(speaking)
    completion = await asyncio.to_thread(
        lambda: sdk(speaking).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            modalities=["text", "audio"],
            audio={"voice": "heart", "format": "wav"},
            **GREEDY,
        )
    )
    message = completion.choices[0].message
    assert message.content is None and message.audio is not None
    assert message.audio.transcript == text
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > 0
    params, got = read_wav(base64.b64decode(message.audio.data))
    assert params.framerate == 24000
    assert got == pcm
    assert got == spoken(text)  # and that is hibari's audio of the transcript


async def test_chat_streams_delta_audio_pieces(speaking: Mesh) -> None:
    text, pcm = await _grpc_speech(speaking)
    data, transcript, expiries = [], [], []
    stream = await async_sdk(speaking).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        modalities=["text", "audio"],
        audio={"voice": "heart", "format": "pcm16"},
        stream=True,
        **GREEDY,
    )
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        audio: Any = getattr(delta, "audio", None)
        if audio is None:
            assert not delta.content  # the text comes as the audio's transcript
            continue
        audio = audio if isinstance(audio, dict) else audio.model_dump()
        data.append(base64.b64decode(audio.get("data") or ""))
        transcript.append(audio.get("transcript") or "")
        if audio.get("expires_at"):
            expiries.append(audio["expires_at"])
    assert "".join(transcript) == text
    assert len([d for d in data if d]) >= 2  # sentence by sentence, not at the end
    assert b"".join(data) == pcm
    assert len(expiries) == 1


def _refused(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value


def _param(error: openai.BadRequestError) -> str:
    body: Any = error.body
    return body["param"]


async def test_refusals_name_the_field(speaking: Mesh) -> None:
    client = sdk(speaking)
    chat: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        (
            lambda: client.audio.speech.create(model=MODEL, input=TEXT, voice="nope"),
            "voice",
            "unknown voice 'nope'",
        ),
        (
            lambda: client.audio.speech.create(
                model=MODEL, input=TEXT, voice="heart", response_format="mp3"
            ),
            "response_format",
            "'wav' or 'pcm'",
        ),
        (
            lambda: client.audio.speech.create(model=MODEL, input=TEXT, voice="heart", speed=4.0),
            "speed",
            "must be in [0.5, 2.0]",
        ),
        (
            lambda: client.chat.completions.create(
                **chat, modalities=["text", "audio"], audio={"voice": "nope", "format": "wav"}
            ),
            "audio.voice",
            "unknown voice 'nope'",
        ),
        (
            lambda: client.chat.completions.create(
                **chat, modalities=["text", "audio"], audio={"voice": "heart", "format": "mp3"}
            ),
            "audio.format",
            "'wav' or 'pcm16'",
        ),
        (
            lambda: client.chat.completions.create(
                **chat,
                modalities=["text", "audio"],
                audio={"voice": "heart", "format": "wav"},
                stream=True,
            ),
            "audio.format",
            "pcm16",
        ),
    ]
    for call, param, words in cases:
        error = await asyncio.to_thread(_refused, call)
        assert _param(error) == param, error.body
        assert words in error.message, error.message


async def test_openai_voice_names_speak_with_the_stages_default_voice(speaking: Mesh) -> None:
    """Apps written for OpenAI name OpenAI's voices: each is an alias of the speech
    stage's default voice, and /v1/audio/voices lists the real voices and the aliases."""
    for voice in ("alloy", "marin", "heart"):
        reply = await asyncio.to_thread(
            lambda v=voice: sdk(speaking).audio.speech.create(
                model=MODEL, input=TEXT, voice=v, response_format="wav"
            )
        )
        assert read_wav(reply.content)[1] == spoken(TEXT), voice
    completion = await asyncio.to_thread(
        lambda: sdk(speaking).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
            **GREEDY,
        )
    )
    assert completion.choices[0].message.audio is not None
    async with httpx.AsyncClient(base_url=speaking.root, timeout=30) as http:
        listing = (await http.get("/v1/audio/voices")).json()
    voices = {v["id"]: v for v in listing["data"]}
    assert voices["heart"] == {"id": "heart", "object": "voice", "default": True}
    assert voices["alloy"]["alias_of"] == "heart" and voices["shimmer"]["alias_of"] == "heart"


class _ThinkerOnly:
    def __init__(self, stages: Stages) -> None:
        self.addresses = {"thinker": stages.addresses["thinker"]}


async def test_a_pipeline_without_a_speaker_refuses_audio(stages: Stages) -> None:
    async with mesh_over(_ThinkerOnly(stages), stages.folder) as mesh:  # type: ignore[arg-type]
        client = sdk(mesh)
        error = await asyncio.to_thread(
            _refused,
            lambda: client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                modalities=["text", "audio"],
                audio={"voice": "heart", "format": "wav"},
            ),
        )
        assert _param(error) == "modalities"
        error = await asyncio.to_thread(
            _refused,
            lambda: client.audio.speech.create(model=MODEL, input=TEXT, voice="heart"),
        )
        assert _param(error) == "model"


async def test_generate_for_one_stage_alone(speaking: Mesh) -> None:
    """The orchestrator's side of /v1/audio/speech: GenerateRequest.stage runs that
    stage alone (no thinker events), and a bad one is refused by name."""
    result = await speaking.client.generate(inputs=_text(TEXT), stage="speaker").collect()
    assert result.ok, result.done
    assert set(result.stages) == {"speaker"}
    samples = [np.frombuffer(t.raw, "<f4") for t in result.stages["speaker"].tensors["audio"]]
    assert wav.pcm16(np.concatenate(samples)) == spoken(TEXT)
    for kwargs, field in [
        ({"stage": "nope"}, "stage"),
        ({"stage": "speaker", "stage_params": {"thinker": {"seed": 1}}}, "stage_params"),
    ]:
        refused = await speaking.client.generate(inputs=_text(TEXT), **kwargs).collect()
        assert refused.done is not None and refused.done.code_name == "INVALID_ARGUMENT"
        assert refused.done.field == field


def _text(text: str) -> stage_pb2.StageInputs:
    return stage_pb2.StageInputs(text=text)


async def test_a_text_answer_does_not_run_the_speaker(speaking: Mesh) -> None:
    # The gateway names the outputs it will use: the speaker runs only for audio.
    # What the orchestrator read from each stage, by the completion's id, says which ran.
    ran = speaking.server.router.recent_bytes
    for modalities in (["text"], ["text", "audio"]):
        audio = {"audio": {"voice": "heart", "format": "wav"}} if "audio" in modalities else {}
        completion = await async_sdk(speaking).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            modalities=modalities,  # type: ignore[arg-type]
            **audio,  # type: ignore[arg-type]
            **GREEDY,  # type: ignore[arg-type]
        )
        speaks = "audio" in modalities
        assert set(ran[completion.id]) == ({"thinker", "speaker"} if speaks else {"thinker"})
        assert (completion.choices[0].message.audio is not None) == speaks
