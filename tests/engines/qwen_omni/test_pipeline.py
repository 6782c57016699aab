"""Qwen3-Omni through the mesh: thinker → talker → code2wav as three real stage
processes behind a real orchestrator, on the tiny random checkpoint. The
client's text ids, the talker's codes and the audio equal the monolithic
``generate(return_audio=True)`` for text, an image and an audio clip sent as
content parts: bit-equal with code2wav's chunk of 300 (the monolithic decode),
and equal to ``chunked_decode`` with the same chunk and left context when
code2wav decodes windows of 8 codes as they come."""

from __future__ import annotations

import asyncio
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from orchestrator.client import Result, content
from services.mesh import wav
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.tensors.codec import from_proto
from tests.engines.qwen_omni.concurrency import CHUNK, CONTEXT, KINDS, QUESTIONS, decided
from tests.engines.qwen_omni.reference import QUESTION, TALKER_TOKENS, THINKER_TOKENS, png, wav_clip
from tests.helpers.float_error import assert_float32_close
from tests.orchestrator.conftest import Stages, orchestrator, pipeline

NAMES = ["thinker", "talker", "code2wav", "code2wav_8", "code2wav_12"]
TO_TALKER = {"from": "thinker", "to": "talker", "window": -1}
# The streamed edge: the prompt's part and the first token, then two tokens at a time.
STREAMED = {"from": "thinker", "to": "talker", "first_window": 2, "window": 2}


def configs(folder: Path, cache: Path) -> dict[str, dict[str, Any]]:
    def stage(name: str, engine: str, **extra: Any) -> dict[str, Any]:
        runtime = {"torch_threads": 1, "max_batch_size": 16, **extra.pop("runtime", {})}
        return {"name": name, "engine": f"qwen_omni_{engine}", "model": str(folder),
                "cache_dir": str(cache), "runtime": runtime, **extra}  # fmt: skip

    return {
        # The hand-off (about 9 KB here) goes by shared memory above 1 KiB.
        "thinker": stage(
            "thinker",
            "thinker",
            runtime={"inline_max_bytes": 1024},
            defaults={"temperature": 0.0, "max_tokens": THINKER_TOKENS},
        ),
        "talker": stage(
            "talker",
            "talker",
            runtime={"streaming_input": True},
            defaults={"temperature": 0.0, "max_tokens": TALKER_TOKENS},
        ),
        "code2wav": stage("code2wav", "code2wav", runtime={"streaming_input": True}),
        "code2wav_8": stage(
            "code2wav_8",
            "code2wav",
            runtime={"streaming_input": True},
            engine_args={"chunk_size": 8, "left_context_size": 25},
        ),
        "code2wav_12": stage(
            "code2wav_12",
            "code2wav",
            runtime={"streaming_input": True},
            engine_args={"chunk_size": CHUNK, "left_context_size": CONTEXT},
        ),
    }


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_omni: Path) -> AsyncIterator[Stages]:
    stages = Stages(tmp_path_factory.mktemp("qwen-omni"))
    try:
        await stages.start(configs(tiny_omni, tmp_path_factory.mktemp("cache")))
        yield stages
    finally:
        await stages.stop()


def codes_of(result: Result) -> torch.Tensor:
    return torch.cat([from_proto(t) for t in result.stages["talker"].tensors["codes"]])


def audio_of(result: Result, stage: str) -> torch.Tensor:
    return torch.cat([from_proto(t) for t in result.stages[stage].tensors["audio"]])


def media(kind: str) -> list[stage_pb2.ContentPart]:
    """The prompt's media as a client sends it (the wire's content parts)."""
    if kind == "image":
        return [content.image(png(), "image/png")]
    if kind == "audio":
        return [content.audio(wav_clip(), "audio/wav")]
    return []


async def run(
    mesh: Stages, vocoder: str, window: dict[str, int], out: Path, kind: str = "text",
    to_talker: dict[str, Any] = TO_TALKER,
) -> Result:  # fmt: skip
    edge = {"from": "talker", "to": vocoder, **window}
    config = pipeline(
        mesh, ["thinker", "talker", vocoder], [to_talker, edge],
        outputs=["thinker", "talker", vocoder],
    )  # fmt: skip
    async with orchestrator(config) as (_, client):
        result = Result(audio_dir=out)
        async for event in client.generate(QUESTION, media=media(kind), request_id="omni"):
            result.add(event)
    assert result.ok, result.done
    return result


@pytest.mark.parametrize("to_talker", [TO_TALKER, STREAMED], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["text", "image", "audio"])
async def test_text_codes_and_audio_equal_the_monolithic_model(
    mesh, reference, tmp_path, kind, to_talker
) -> None:
    want = reference(kind)
    result = await run(
        mesh, "code2wav", {"window": 4, "first_window": 2}, tmp_path, kind, to_talker
    )
    thinker = result.stages["thinker"]
    assert thinker.token_ids == want.answer_ids
    # The hand-off is not the client's.
    assert not {"hidden_states", "prompt_hidden_states"} & set(thinker.tensors)
    assert torch.equal(codes_of(result), want.codes)
    assert torch.equal(audio_of(result, "code2wav"), want.audio)
    with wave.open(str(tmp_path / "omni-code2wav.wav")) as clip:
        assert (clip.getframerate(), clip.getnframes()) == (24000, len(want.audio))
        pcm = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2")
    assert pcm.tobytes() == wav.pcm16(want.audio.numpy())


async def test_windows_of_codes_decode_as_chunked_decode(
    mesh, reference, tiny_omni, tmp_path
) -> None:
    from transformers import Qwen3OmniMoeCode2Wav

    from services.engines.qwen_omni import loading

    want = reference("text")
    result = await run(mesh, "code2wav_8", {"window": 8, "first_window": 3}, tmp_path)
    segments = result.stages["code2wav_8"].tensors["audio"]
    assert len(segments) == -(-len(want.codes) // 8)  # one segment per chunk of 8, in order
    model, _ = loading.load_part(tiny_omni, "code2wav", torch.float32, "cpu")
    assert isinstance(model, Qwen3OmniMoeCode2Wav)
    with torch.no_grad():
        chunked = model.chunked_decode(want.codes.T[None], 8, 25).reshape(-1)
    assert torch.equal(audio_of(result, "code2wav_8"), chunked)


async def test_a_video_is_refused_naming_the_stage_and_kind(mesh) -> None:
    config = pipeline(
        mesh, ["thinker", "talker", "code2wav"], [TO_TALKER, {"from": "talker", "to": "code2wav"}]
    )
    async with orchestrator(config) as (_, client):
        result = Result()
        video = content.media_part("video", b"\x00\x00\x00\x18ftypmp42", "video/mp4")
        async for event in client.generate(QUESTION, media=[video], request_id="film"):
            result.add(event)
    assert result.done is not None and result.done.code_name == "INVALID_ARGUMENT"
    assert "thinker" in result.done.message and "video" in result.done.message
    assert "talker" not in result.stages and "code2wav" not in result.stages


async def test_concurrent_requests_through_the_mesh_give_what_they_give_alone(
    mesh, alone, tmp_path
) -> None:
    """Eight requests at once through the three stage processes and the orchestrator,
    on the streamed edge, one of them cancelled mid-answer: the other seven's text,
    codes and audio are their own served alone (by concurrency.py's rule: every
    choice here is decided, so the same ids and codes; the audio within float32's
    error of float64), and the cancelled one ends CANCELLED."""
    trusted, exact = alone
    config = pipeline(
        mesh, ["thinker", "talker", "code2wav_12"],
        [STREAMED, {"from": "talker", "to": "code2wav_12", "window": CHUNK}],
        outputs=["thinker", "talker", "code2wav_12"],
    )  # fmt: skip
    count, victim = 8, 3

    async def one(client: Any, index: int) -> Result:
        result, aborted = Result(), False
        question, kind = QUESTIONS[index], KINDS[index % len(KINDS)]
        stream = client.generate(question, media=media(kind), request_id=f"m{index}")
        async for event in stream:
            result.add(event)
            spoken = "code2wav_12" in result.stages  # its first audio: mid-answer
            if index == victim and spoken and not aborted:
                aborted = True
                await client.abort(f"m{index}")
        return result

    async with orchestrator(config) as (_, client):
        results = await asyncio.gather(*(one(client, i) for i in range(count)))
    assert results[victim].done is not None and results[victim].done.code_name == "CANCELLED"
    compared = 0
    for index, result in enumerate(results):
        if index == victim:
            continue
        assert result.ok, result.done
        if not decided(trusted[index], exact[index]):
            continue  # a near-tie alone: the engine-level rule covers it
        compared += 1
        audio = [from_proto(t) for t in result.stages["code2wav_12"].tensors["audio"]]
        assert result.stages["thinker"].token_ids == trusted[index].ids
        assert torch.equal(codes_of(result), trusted[index].codes)
        for m, t, e in zip(audio, trusted[index].audio, exact[index].audio, strict=True):
            assert_float32_close(m[None], t[None], e[None])
    assert compared >= 5
