"""What a stage promises an engine about one request: every whole output the
engine emits reaches the client (a later window's never overwrites an earlier
one), and an engine that keeps state per request is told once it has ended; and
what it promises its client: a request ended at any moment ends once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.engines.base import EngineRequest, SamplingParams
from services.mesh.errors import Cancelled
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.stage.serving.inputs import InputWindows
from services.stage.serving.requests import RequestRecord
from tests.helpers.polling import eventually
from tests.helpers.stage import cancel


@pytest.fixture(scope="module")
async def stage(tmp_path_factory: pytest.TempPathFactory):
    config = {
        "name": "scripted",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path_factory.mktemp("cache")),
        "runtime": {"max_batch_size": 4, "streaming_input": True},
        "segmenting": {"max_segment_tokens": 64, "min_flush_interval_ms": 60_000},
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=30)
        yield server, client
    await server.stop(1.0)


def window(rid: str, seq: int, last: bool, text: str) -> stage_pb2.StageInput:
    submit = stage_pb2.Submit(request_id=rid, sequence=seq, is_last=last)
    submit.inputs.text = text
    return stage_pb2.StageInput(submit=submit)


async def run(client: StageClient, messages: list[stage_pb2.StageInput]) -> list:
    call = client.open_stream()
    for message in messages:
        await call.write(message)
    await call.done_writing()
    return [output async for output in call]


async def test_every_window_s_outputs_arrive_none_overwritten(stage) -> None:
    server, client = stage
    # Two windows of one streaming request, each emitting three "frame" outputs
    # with no flush in between: all six reach the client, in order.
    outputs = await run(
        client, [window("w", 0, False, "tensors 3"), window("w", 1, True, "tensors 3")]
    )
    frames = [
        codec.from_proto(t).item()
        for out in outputs
        if out.WhichOneof("kind") == "segment"
        for t in out.segment.tensors
    ]
    assert frames == [0, 1, 2, 0, 1, 2]
    assert outputs[-1].WhichOneof("kind") == "completed"
    assert server.engine.released.count("w") == 1


async def test_the_engine_hears_of_the_end_on_every_path(stage) -> None:
    server, client = stage
    await run(client, [window("done", 0, True, "plain")])
    call = client.open_stream()
    await call.write(window("cut", 0, True, "hold"))
    await call.read()  # its first token: it is running
    await call.write(cancel("cut"))
    await call.done_writing()
    outputs = []
    while (output := await call.read()) is not grpc.aio.EOF:
        outputs.append(output)
    assert outputs[-1].error.code_name == "CANCELLED"
    gone = client.open_stream()
    await gone.write(window("gone", 0, True, "hold"))
    await gone.read()
    gone.cancel()  # the client's stream goes away mid-request
    # The stage notices the stream is gone, then ends the request.
    await eventually(lambda: "gone" in server.engine.released, 2, message="never released")
    assert [r for r in server.engine.released if r in {"done", "cut", "gone"}] == [
        "done",
        "cut",
        "gone",
    ]


class _Collected:
    """A stream's output side reduced to a list: what the runtime emitted."""

    def __init__(self) -> None:
        self.events: list[object] = []

    async def emit(self, record: RequestRecord, event: object) -> None:
        self.events.append(event)


async def test_a_request_ended_before_its_task_first_ran_still_ends_once(stage) -> None:
    """A task cancelled before its first step never runs its body. A request ended
    then (a Cancel read right behind its Submit, an Abort, its stream gone) once got
    no final event and stayed in flight for ever, its id refused on every stream."""
    server, _client = stage
    runtime = server.runtime
    for rid, end in (("early", "cancel"), ("orphan", "stream gone")):
        out = _Collected()
        record = RequestRecord(
            request_id=rid,
            emitter=out,
            consumer=None,
            transform="",
            params=SamplingParams(),
            windows=InputWindows(rid),
        )
        runtime.requests.add(record)
        await runtime.start(record, EngineRequest(request_id=rid, text="hold"))
        assert record.task is not None and not record.task.done()  # nothing has yielded since
        if end == "cancel":
            await runtime.end(record, Cancelled(f"request {rid}: cancelled at once"))
            assert [type(e).__name__ for e in out.events] == ["ErrorOut"]
        else:
            runtime.drop_stream(out)
            assert out.events == []  # nobody to tell
        await asyncio.sleep(0.05)  # the task's turn: it must not run now
        assert runtime.requests.live(rid) is None
        assert len(out.events) == (1 if end == "cancel" else 0)
