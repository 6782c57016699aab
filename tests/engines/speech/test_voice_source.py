"""A voice given by URL or hub id, in a real stage process: fetched in the
stage's download phase (DOWNLOAD_START / PROGRESS / DONE, which the init
watchdog pauses for), then spoken bit-equal to hibari with that file in process;
the packaged voice fetches nothing; a bad URL fails start-up naming it.

The voice served is a copy of the packaged one under another name: a real
hibari voice file, 7.9 MB, from a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hibari import Hibari
from hibari.voices import voice_path

from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import write_config
from tests.engines.speech.conftest import speaker_config
from tests.engines.speech.test_speaker_stage import audio_pieces, run, submit
from tests.helpers.fake_hub import FakeHub
from tests.helpers.http_server import FileServer

TEXT = "I can't schedule a tomato for the garage."
PACKAGED = Path(voice_path("heart"))
PACKAGED_BYTES = PACKAGED.stat().st_size


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileServer]:
    root = tmp_path_factory.mktemp("voices")
    shutil.copyfile(PACKAGED, root / "my_voice.onnx")
    # Throttled to about half a second, so the download reports progress on the way.
    with FileServer(root, rate_bps=16_000_000) as server:
        yield server


@asynccontextmanager
async def stage(
    tmp_path: Path, voices: list[Any], env: dict[str, str] | None = None
) -> AsyncIterator[tuple[StageClient, list[stage_pb2.InitEvent]]]:
    config = speaker_config(str(tmp_path / "cache"), voices=voices)
    process = StageProcess(write_config(tmp_path / "speaker.yaml", config), env=env)
    address = await process.start()
    try:
        async with StageClient(address) as client:
            yield client, [e async for e in client.init_events()]
    finally:
        assert await process.stop() == 0


def downloads(events: list[stage_pb2.InitEvent]) -> list[tuple[str, str, bool]]:
    """(phase, source, cache_hit) of the download events, PROGRESS as one entry."""
    seen: list[tuple[str, str, bool]] = []
    for e in events:
        name = stage_pb2.InitPhase.Name(e.phase)
        if name.startswith("DOWNLOAD") and (not seen or seen[-1][0] != name):
            seen.append((name, e.source, e.cache_hit))
    return seen


def phases(events: list[stage_pb2.InitEvent]) -> list[str]:
    return [stage_pb2.InitPhase.Name(e.phase) for e in events]


async def test_the_packaged_voice_downloads_nothing(tmp_path: Path) -> None:
    async with stage(tmp_path, ["heart"]) as (_, events):
        assert phases(events)[-1] == "READY", events[-1].reason
        # Only the tokenizer's GGUF, found in its package: no download at all.
        assert [(p, hit) for p, _, hit in downloads(events)] == [
            ("DOWNLOAD_START", False),
            ("DOWNLOAD_DONE", True),
        ]


async def test_a_voice_by_url_downloads_then_speaks_as_hibari_does(
    tmp_path: Path, served: FileServer
) -> None:
    url = served.url("my_voice.onnx")
    voice = {"name": "mine", "source": url, "british": True}
    async with stage(tmp_path, ["heart", voice]) as (client, events):
        assert phases(events)[-1] == "READY", events[-1].reason
        fetched = downloads(events)[2:]  # after the tokenizer's
        assert fetched == [
            ("DOWNLOAD_START", url, False),
            ("DOWNLOAD_PROGRESS", "", False),
            ("DOWNLOAD_DONE", url, False),
        ]
        done = next(e for e in events if e.phase == stage_pb2.DOWNLOAD_DONE and e.source == url)
        assert done.bytes_done == PACKAGED_BYTES
        # The download comes before the load and the warm-up, as the model's does.
        order = phases(events)
        assert order.index("LOAD_START") > len(order) - 1 - order[::-1].index("DOWNLOAD_DONE")
        result = (await run(client, submit("u", TEXT, voice="mine")))["u"]
    assert result.error is None, result.error
    (audio,) = audio_pieces(result)
    # hibari in process, with the file served and the British rules it was asked for.
    own = Hibari(voice="emma", model=str(served.root / "my_voice.onnx"))
    assert np.array_equal(audio, own(TEXT, seed=0))
    assert not np.array_equal(audio, Hibari()(TEXT, seed=0))  # the accent was honoured


async def test_a_voice_by_hub_id_downloads_through_the_configured_endpoint(
    tmp_path: Path, served: FileServer
) -> None:
    voice_file = await asyncio.to_thread((served.root / "my_voice.onnx").read_bytes)
    files = {"README.md": b"a hibari voice", "voice.onnx": voice_file}
    with FakeHub("voices/mine", files) as hub:
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path)}
        voice = {"name": "mine", "source": "hf://voices/mine"}
        async with stage(tmp_path, [voice], env) as (client, events):
            assert phases(events)[-1] == "READY", events[-1].reason
            assert downloads(events)[-1] == ("DOWNLOAD_DONE", "hf://voices/mine", False)
            result = (await run(client, submit("h", TEXT)))["h"]  # the first voice: default
    assert sorted(hub.downloads) == ["README.md", "voice.onnx"]
    assert result.error is None, result.error
    (audio,) = audio_pieces(result)
    (copy,) = (tmp_path / "hub").rglob("voice.onnx")
    assert np.array_equal(audio, Hibari(model=str(copy))(TEXT, seed=0))


async def test_a_bad_voice_url_fails_start_up_naming_it(tmp_path: Path, served: FileServer) -> None:
    url = served.url("nobody.onnx")
    async with stage(tmp_path, [{"name": "nobody", "source": url}]) as (client, events):
        failed = events[-1]
        assert failed.phase == stage_pb2.FAILED
        assert "'nobody'" in failed.reason and url in failed.reason and "404" in failed.reason
        result = (await run(client, submit("x", TEXT)))["x"]
        assert result.error is not None and result.error.code_name == "UNAVAILABLE"
