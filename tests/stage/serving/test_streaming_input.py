"""runtime.streaming_input: each input window runs through the engine as it
arrives, and the request's output continues one segment sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config
from tests.helpers.stage import collect


@pytest.fixture(scope="module")
async def decoder(omni_cache_dir: Path, smollm2_gguf: Path):
    config = tiny_config(
        "decoder",
        omni_cache_dir,
        runtime={"streaming_input": True},
        segmenting={"max_segment_tokens": 2, "min_flush_interval_ms": 10_000},
    )
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=120)
        yield server, client
    await server.stop(1.0)


def window(rid: str, seq: int, last: bool, ids: list[int]) -> stage_pb2.StageInput:
    submit = stage_pb2.Submit(request_id=rid, sequence=seq, is_last=last)
    submit.inputs.token_ids.extend(ids)
    submit.params.max_tokens = 3
    submit.params.seed = seq
    return stage_pb2.StageInput(submit=submit)


async def test_each_window_is_decoded_as_it_arrives(decoder) -> None:
    _server, client = decoder
    call = client.open_stream()
    await call.write(window("w", 0, False, [10, 11]))
    first = await call.read()  # output of window 0 before window 1 was even sent
    assert first.segment.request_id == "w" and first.segment.sequence == 0
    await call.write(window("w", 1, False, [12]))
    await call.write(window("w", 2, True, [13, 14]))
    await call.done_writing()
    results = await collect(call)
    result = results["w"]
    segments = [first.segment, *result.segments]
    assert [s.sequence for s in segments] == list(range(len(segments)))
    assert segments[-1].is_last and not any(s.is_last for s in segments[:-1])
    assert sum(len(s.token_ids) for s in segments) == 9  # 3 windows x max_tokens 3
    assert result.completed.usage.completion_tokens == 9
    assert result.completed.usage.prompt_tokens == 5


async def test_a_window_out_of_sequence_ends_only_its_request(decoder) -> None:
    server, client = decoder
    call = client.open_stream()
    await call.write(window("bad", 0, False, [10]))
    await call.write(window("bad", 2, True, [11]))
    await call.write(window("good", 0, True, [12]))
    await call.done_writing()
    results = await collect(call)
    assert results["bad"].error.code_name == "INVALID_ARGUMENT"
    assert results["bad"].error.field == "submit.sequence"
    assert results["good"].completed is not None
    assert server.runtime.in_flight == 0


async def test_an_empty_last_window_only_ends_the_input(decoder) -> None:
    _server, client = decoder
    call = client.open_stream()
    await call.write(window("e", 0, False, [10, 11]))
    await call.write(window("e", 1, True, []))
    await call.done_writing()
    result = (await collect(call))["e"]
    assert result.error is None and result.completed.usage.completion_tokens == 3
