"""Per-request flow control, deadlines and an early end of input on one shared
Generate stream of a real stage (in this process, so its records can be read)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config
from tests.helpers.stage import chat


@pytest.fixture(scope="module")
async def stage(omni_cache_dir: Path, smollm2_gguf: Path):
    config = tiny_config(
        "solo",
        omni_cache_dir,
        runtime={"torch_threads": 1, "max_batch_size": 4, "max_queue_size": 8},
    )
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=300)
        yield server, client
    await server.stop(1.0)


async def read_until(
    call: grpc.aio.StreamStreamCall, seen: list[stage_pb2.StageOutput], done
) -> None:
    while not done():
        output = await asyncio.wait_for(call.read(), 60)
        assert output is not grpc.aio.EOF
        seen.append(output)


def of(seen: list[stage_pb2.StageOutput], rid: str, kind: str) -> list:
    return [
        getattr(o, kind)
        for o in seen
        if o.WhichOneof("kind") == kind and getattr(o, kind).request_id == rid
    ]


async def test_a_request_out_of_credit_pauses_while_others_on_the_stream_go_on(stage) -> None:
    server, client = stage
    call = client.open_stream()
    seen: list[stage_pb2.StageOutput] = []
    try:
        slow = chat("slow", "Write at length.", max_tokens=120)
        slow.submit.credit = 2
        await call.write(slow)
        await read_until(call, seen, lambda: len(of(seen, "slow", "segment")) == 2)
        record = server.runtime.requests.live("slow")
        assert record is not None and record.credit is not None
        # A request without credit (a direct client) on the same stream runs to its end.
        await call.write(chat("fast", "Hi", max_tokens=12))
        mark = len(seen)
        await read_until(call, seen, lambda: bool(of(seen, "fast", "completed")))
        assert sum(len(s.token_ids) for s in of(seen, "fast", "segment")) == 12
        # Meanwhile "slow" sent nothing: it is paused with no credit left.
        assert not [
            o
            for o in seen[mark:]
            if o.WhichOneof("kind") != "completed"
            and getattr(o, o.WhichOneof("kind")).request_id == "slow"
        ]
        assert record.credit.left == 0 and server.runtime.requests.live("slow") is record
        # Credit back: it resumes and ends with every token, in order.
        credit = stage_pb2.Credit(request_id="slow", outputs=1000)
        await call.write(stage_pb2.StageInput(credit=credit))
        await read_until(call, seen, lambda: bool(of(seen, "slow", "completed")))
        segments = of(seen, "slow", "segment")
        assert [s.sequence for s in segments] == list(range(len(segments)))
        tokens = [t for s in segments for t in s.token_ids]
        assert len(tokens) == of(seen, "slow", "completed")[0].usage.completion_tokens == 120
        # A Credit for an id not in flight (it crossed the final event) is ignored.
        await call.write(stage_pb2.StageInput(credit=credit))
        await call.write(chat("after", "Hi", max_tokens=4))
        await read_until(call, seen, lambda: bool(of(seen, "after", "completed")))
        assert not of(seen, "slow", "error")
    finally:
        call.cancel()


async def test_submit_timeout_ms_ends_one_request_deadline_exceeded(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    seen: list[stage_pb2.StageOutput] = []
    try:
        late = chat("late", "Write at length.", max_tokens=3000)
        late.submit.timeout_ms = 300
        await call.write(late)
        await call.write(chat("other", "Hi", max_tokens=8))
        await read_until(
            call,
            seen,
            lambda: bool(of(seen, "late", "error")) and bool(of(seen, "other", "completed")),
        )
        (error,) = of(seen, "late", "error")
        assert error.code_name == "DEADLINE_EXCEEDED" and "300 ms" in error.message
        assert len(of(seen, "late", "segment")) >= 1  # it ran until then
        assert not of(seen, "other", "error")
    finally:
        call.cancel()


async def test_input_ended_ends_one_request_waiting_for_its_last_window(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    seen: list[stage_pb2.StageOutput] = []
    try:
        first = chat("cut", "Hello", max_tokens=4)
        first.submit.is_last = False
        await call.write(first)
        ended = stage_pb2.Submit(request_id="cut", input_ended=True)
        await call.write(stage_pb2.StageInput(submit=ended))
        await call.write(chat("whole", "Hi", max_tokens=4))
        await read_until(
            call,
            seen,
            lambda: bool(of(seen, "cut", "error")) and bool(of(seen, "whole", "completed")),
        )
        (error,) = of(seen, "cut", "error")
        assert (error.code_name, error.field) == ("INVALID_ARGUMENT", "submit.is_last")
        # For an id that has just ended here, input_ended crossed its end: nothing
        # more (the id had its one final event). For an id never seen, one NOT_FOUND,
        # as an unknown Cancel gets; the stream goes on.
        await call.write(stage_pb2.StageInput(submit=ended))
        unknown = stage_pb2.Submit(request_id="nobody", input_ended=True)
        await call.write(stage_pb2.StageInput(submit=unknown))
        await call.write(chat("last", "Hi", max_tokens=4))
        await read_until(call, seen, lambda: bool(of(seen, "last", "completed")))
        assert len(of(seen, "cut", "error")) == 1
        (late,) = of(seen, "nobody", "error")
        assert (late.code_name, late.field) == ("NOT_FOUND", "submit.input_ended")
    finally:
        call.cancel()
