"""Chat content parts end to end: a client sends text, an image and audio through
a real orchestrator to real stages, and the stage's engine reports what it got
(services/testing/media_engine.py): kinds, media types, bytes and PCM, in order.

Both servers here accept messages of at most 2 MiB, so the 5 MiB image (and the
2.8 MB of PCM) arrive only because they travelled as chunks (client ->
orchestrator -> stage)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.client import AsyncClient, Result, content
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer

MIB = 1 << 20
LIMIT = 2 * MIB  # max_message_bytes of the orchestrator and the stages
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * (5 * MIB // 256)  # 5 MiB "image"
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x01" * 64
SAMPLES = [0.0, 0.5, -0.25, 1.0, -1.0, 1e-7, 0.125] * 100_000  # 2.8 MB of float32: chunked too


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_file(name: str, engine: str, cache: Path) -> dict[str, Any]:
    return {
        "name": name,
        "engine": f"services.testing.media_engine:{engine}",
        "load_format": "dummy",
        "cache_dir": str(cache),
        "runtime": {"max_message_bytes": LIMIT, "max_batch_size": 4},
        "segmenting": {"max_segment_tokens": 1, "min_flush_interval_ms": 0},
    }


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AsyncClient]:
    cache = tmp_path_factory.mktemp("cache")
    stages = {
        "thinker": StageServer(parse_stage_config(stage_file("thinker", "MediaEngine", cache))),
        "talker": StageServer(parse_stage_config(stage_file("talker", "TextOnlyEngine", cache))),
    }
    addresses = {name: f"127.0.0.1:{await s.start('127.0.0.1', 0)}" for name, s in stages.items()}
    config = parse_pipeline(
        {
            "name": "content",
            "stages": [{"name": "thinker", "address": addresses["thinker"]}],
            "edges": [],
            "runtime": {"max_message_bytes": LIMIT, "max_input_bytes": 16 * MIB},
        },
        "content.yaml",
    )
    server = OrchestratorServer(config)
    port = await server.start("127.0.0.1", 0)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=60)
            client.stage_addresses = addresses  # type: ignore[attr-defined]
            yield client
    finally:
        await server.stop(1.0)
        for stage in stages.values():
            await stage.stop(1.0)


async def ask(client: AsyncClient, *messages: stage_pb2.ChatMessage) -> Result:
    return await client.generate(inputs=stage_pb2.StageInputs(messages=messages)).collect()


def echoed(result: Result) -> dict[str, Any]:
    assert result.ok, result.done
    return json.loads(result.stages["thinker"].text)


async def test_the_engine_gets_every_part_in_order_bytes_and_pcm_equal(mesh) -> None:
    system = content.chat_message("system", "Describe what you are given.")
    user = content.chat_message(
        "user",
        "Look:",
        content.image(PNG, "image/png"),
        content.audio(WAV, "audio/wav"),
        "and listen:",
        content.pcm(SAMPLES, 16000),
    )
    got = echoed(await ask(mesh, system, user))
    assert got["messages"] == [
        ["system", "Describe what you are given."],
        ["user", "Look:\nand listen:"],
    ]
    pcm = array("f", SAMPLES).tobytes()
    assert got["turns"] == [
        {"role": "system", "content": "Describe what you are given.", "parts": []},
        {"role": "user", "content": "Look:\nand listen:", "parts": [
            {"text": "Look:"},
            {"kind": "image", "media_type": "image/png", "nbytes": len(PNG), "sha256": sha(PNG)},
            {"kind": "audio", "media_type": "audio/wav", "nbytes": len(WAV), "sha256": sha(WAV)},
            {"text": "and listen:"},
            {"kind": "audio", "media_type": "audio/pcm", "dtype": "float32",
             "shape": [len(SAMPLES)], "sample_rate": 16000, "sha256": sha(pcm)},
        ]},
    ]  # fmt: skip


async def test_a_large_image_would_not_fit_one_message(mesh) -> None:
    """The same request as one unary message is refused by the size limit: only the
    chunks got the image through above."""
    request = stage_pb2.StageInputs(
        messages=[content.chat_message("user", content.image(PNG, "image/png"), "?")]
    )
    assert request.ByteSize() > LIMIT
    call = mesh.stub.Generate(orchestrator_pb2.GenerateRequest(inputs=request))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_an_old_client_sending_content_still_works(mesh) -> None:
    got = echoed(await mesh.generate("Hello there").collect())
    assert got == {"messages": [["user", "Hello there"]], "turns": []}


VIDEO = content.media_part("video", b"\x00\x00\x00\x18ftypmp42", "video/mp4")


async def test_a_part_the_engine_does_not_take_is_refused_by_name(mesh) -> None:
    """The orchestrator knows what the entry stage takes (its Describe): the video
    is refused at the front door, in the stage's words, before it travels on."""
    result = await ask(mesh, content.chat_message("user", "hi", VIDEO))
    done = result.done
    assert done is not None and done.code_name == "INVALID_ARGUMENT"
    assert done.field == "inputs.messages[0].parts[1].video" and done.stage == ""
    assert "stage thinker takes text, image and audio, not video" in done.message
    # A GenerateStream's Submit alike, under its own field.
    submit = stage_pb2.Submit(request_id="v", is_last=True)
    submit.inputs.messages.add().CopyFrom(content.chat_message("user", VIDEO))
    call = mesh.stub.GenerateStream([orchestrator_pb2.StreamInput(submit=submit)])
    dones = [e.done async for e in call if e.WhichOneof("kind") == "done"]
    assert len(dones) == 1
    done = dones[0]
    assert done.field == "submit.inputs.messages[0].parts[0].video"


async def test_the_stage_itself_refuses_a_kind_by_name(mesh) -> None:
    """The stage checks too (a client of the stage, or an orchestrator that has not
    described it yet): its Error names the part."""
    submit = stage_pb2.Submit(request_id="direct", is_last=True)
    submit.inputs.messages.add().CopyFrom(content.chat_message("user", "hi", VIDEO))
    async with StageClient(mesh.stage_addresses["thinker"]) as stage:
        outputs = [o async for o in stage.generate(submit)]
    error = outputs[-1].error
    assert error.code_name == "INVALID_ARGUMENT"
    assert error.field == "inputs.messages[0].parts[1].video"
    assert error.message.endswith("stage thinker takes text, image and audio, not video")


async def test_a_text_only_stage_refuses_an_image_by_name(mesh) -> None:
    pipeline = parse_pipeline(
        {
            "name": "text",
            "stages": [{"name": "talker", "address": mesh.stage_addresses["talker"]}],
            "edges": [],
        },
        "text.yaml",
    )
    server = OrchestratorServer(pipeline)
    port = await server.start("127.0.0.1", 0)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=60)
            image = content.image(b"\xff\xd8\xff\xe0jpeg", "image/jpeg")
            done = (await client.generate("What is it?", media=[image]).collect()).done
    finally:
        await server.stop(1.0)
    assert done is not None and done.code_name == "INVALID_ARGUMENT"
    assert done.field == "inputs.messages[0].parts[0].image"
    assert "stage talker takes text, not image" in done.message


def with_media(**media: Any) -> stage_pb2.ChatMessage:
    kind = media.pop("kind", "image")
    part = stage_pb2.ContentPart()
    getattr(part, kind).CopyFrom(stage_pb2.Media(**media))
    return stage_pb2.ChatMessage(role="user", parts=[stage_pb2.ContentPart(text="hi"), part])


PCM_OK = {"dtype": "float32", "shape": [2], "raw": bytes(8)}


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (with_media(media_type="", data=b"x"), "parts[1].image.media_type"),
        (with_media(media_type="image/pgn", data=b"x"), "parts[1].image.media_type"),
        (with_media(media_type="audio/wav", data=b"x"), "parts[1].image.media_type"),
        (with_media(media_type="image/png", data=b""), "parts[1].image.data"),
        (with_media(kind="audio", media_type="audio/pcm", data=b"x"), "parts[1].audio.media_type"),
        (
            with_media(kind="audio", pcm={**PCM_OK, "dtype": "int16", "raw": bytes(4)},
                       sample_rate=16000),
            "parts[1].audio.pcm.dtype",
        ),
        (
            with_media(kind="audio", pcm={**PCM_OK, "shape": [1, 2]}, sample_rate=16000),
            "parts[1].audio.pcm.shape",
        ),
        (with_media(kind="audio", pcm=PCM_OK, sample_rate=0), "parts[1].audio.sample_rate"),
        (with_media(kind="image", pcm=PCM_OK, sample_rate=8000), "parts[1].image.pcm"),
        (
            stage_pb2.ChatMessage(
                role="user", content="x", parts=[stage_pb2.ContentPart(text="y")]
            ),
            "content",
        ),
        (stage_pb2.ChatMessage(role="user", parts=[stage_pb2.ContentPart()]), "parts[0]"),
    ],
)  # fmt: skip
async def test_bad_parts_are_refused_naming_the_field(mesh, message, field) -> None:
    done = (await ask(mesh, stage_pb2.ChatMessage(role="system", content="s"), message)).done
    assert done is not None and done.code_name == "INVALID_ARGUMENT", done
    assert done.field == f"inputs.messages[1].{field}"
    assert done.message.startswith(f"stage thinker: INVALID_ARGUMENT: {done.field}: ")


async def test_media_chunks_count_against_the_input_budget(mesh) -> None:
    image = content.image(PNG * 4, "image/png")  # 20 MiB: over max_input_bytes (16 MiB)
    done = (await mesh.generate("?", media=[image]).collect()).done
    assert done is not None and done.code_name == "RESOURCE_EXHAUSTED"
    assert done.field == "submit.inputs.messages[0].parts[0].image"
    assert "its chunks were refused" in done.message and "at most 16777216" in done.message


async def test_describe_lists_the_kinds_a_stage_takes(mesh) -> None:
    for name, kinds in (("thinker", ["audio", "image", "text"]), ("talker", ["text"])):
        async with StageClient(mesh.stage_addresses[name]) as stage:
            assert list((await stage.describe()).accepts) == kinds


OMNI = str(Path(sys.executable).parent / "omni")


async def omni(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        OMNI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_omni_generate_sends_image_and_audio_files(mesh, tmp_path: Path) -> None:
    # Suffixes that lie: the type comes from the files' first bytes.
    image, clip = tmp_path / "picture.bin", tmp_path / "clip.wav"
    image.write_bytes(PNG)
    clip.write_bytes(WAV)
    code, out, err = await omni(
        "generate", "What is this?", "--image", str(image), "--audio", str(clip),
        "--address", mesh.address, "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 0, err
    parts = json.loads(out)["turns"][0]["parts"]
    assert [p.get("media_type") for p in parts] == ["image/png", "audio/wav", None]
    assert parts[0]["sha256"] == sha(PNG) and parts[1]["sha256"] == sha(WAV)
    assert parts[2] == {"text": "What is this?"}


async def test_omni_generate_names_a_file_it_cannot_send(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    missing = tmp_path / "missing.png"
    for flag, path, why in (("--image", missing, "cannot read it"),
                            ("--image", notes, "of no known type, not image"),
                            ("--audio", notes, "of no known type, not audio")):  # fmt: skip
        code, _out, err = await omni("generate", "hi", flag, str(path), "--address", "127.0.0.1:1")
        assert code == 2
        assert f"omni generate: {path}: {why}" in err
    # omni up reads its files before it starts anything.
    code, _out, err = await omni("up", "--prompt", "hi", "--image", str(missing))
    assert code == 2 and f"omni up: {missing}: cannot read it" in err
    code, _out, err = await omni("up", "--image", str(notes))  # nothing to send it with
    assert code == 2 and "omni up: --image and --audio go with --prompt" in err
