"""The stage's input budget under a flood, against a real stage server: streams
holding unfinished windows and chunks are refused RESOURCE_EXHAUSTED past the
cap of their stream or of the process, the process never holds more than its
cap, other requests keep completing, and every byte comes back."""

from __future__ import annotations

from collections import defaultdict

import grpc
import pytest

from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from tests.helpers.stage import Result, cancel, chat, collect, record

MIB = 1 << 20
PER_STREAM = 8 * MIB
PER_PROCESS = 20 * MIB
MAX_WINDOWS = 50


@pytest.fixture
async def stage(tmp_path):
    config = {
        "name": "budget",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path / "cache"),
        "runtime": {
            "max_batch_size": 4,
            "max_input_bytes": PER_STREAM,
            "max_process_input_bytes": PER_PROCESS,
            "max_input_windows": MAX_WINDOWS,
        },
        "segmenting": {"max_segment_tokens": 1, "min_flush_interval_ms": 0},
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=30)
        yield server, client
    await server.stop(1.0)


def window(rid: str, sequence: int, nbytes: int, last: bool = False) -> stage_pb2.StageInput:
    tensor = tensor_pb2.Tensor(name="x", dtype="uint8", shape=[nbytes], raw=bytes(nbytes))
    submit = stage_pb2.Submit(
        request_id=rid,
        sequence=sequence,
        is_last=last,
        inputs=stage_pb2.StageInputs(tensors=[tensor]),
    )
    return stage_pb2.StageInput(submit=submit)


class Stream:
    """One Generate stream; ``barrier`` returns once the stage has handled every
    message written before it (a Cancel of an unknown id is answered in order)."""

    def __init__(self, client: StageClient, name: str) -> None:
        self.call = client.open_stream()
        self.name = name
        self.results: dict[str, Result] = defaultdict(Result)
        self.errors: list[stage_pb2.Error] = []  # in order, every request's
        self._barriers = 0

    async def write(self, *messages: stage_pb2.StageInput) -> None:
        for message in messages:
            await self.call.write(message)

    async def barrier(self) -> None:
        self._barriers += 1
        rid = f"{self.name}-barrier-{self._barriers}"
        await self.call.write(cancel(rid))
        while True:
            output = await self.call.read()
            assert output is not grpc.aio.EOF, "the stream ended before the barrier"
            self._keep(output)
            if output.WhichOneof("kind") == "error" and output.error.request_id == rid:
                assert output.error.code_name == "NOT_FOUND"
                return

    async def close(self) -> dict[str, Result]:
        await self.call.done_writing()
        while (output := await self.call.read()) is not grpc.aio.EOF:
            self._keep(output)
        assert await self.call.code() == grpc.StatusCode.OK
        return self.results

    def first_error(self, rid: str) -> stage_pb2.Error:
        return next(e for e in self.errors if e.request_id == rid)

    def _keep(self, output: stage_pb2.StageOutput) -> None:
        if output.WhichOneof("kind") == "error":
            self.errors.append(output.error)
        record(self.results, output)


async def ordinary(client: StageClient, rid: str) -> Result:
    call = client.open_stream()
    await call.write(chat(rid, "hello", max_tokens=4))
    await call.done_writing()
    return (await collect(call))[rid]


async def test_window_floods_hit_the_stream_and_process_caps_and_give_everything_back(
    stage,
) -> None:
    server, client = stage
    budget = server.runtime.budget
    streams = [Stream(client, name) for name in ("a", "b", "c")]
    # a and b each hold 7 MiB of unfinished windows: under their stream's cap.
    for stream in streams[:2]:
        await stream.write(*(window(f"{stream.name}-flood", i, MIB) for i in range(7)))
        await stream.barrier()
        assert budget.held <= PER_PROCESS
    assert 14 * MIB < budget.held <= PER_PROCESS
    # c would pass the process's cap before its stream's: refused, and nothing of it kept.
    c = streams[2]
    await c.write(*(window("c-flood", i, MIB) for i in range(7)))
    await c.barrier()
    assert budget.held <= PER_PROCESS
    refused = c.first_error("c-flood")
    assert (refused.code_name, refused.field) == ("RESOURCE_EXHAUSTED", "inputs")
    assert "max_process_input_bytes" in refused.message
    # Meanwhile other requests still run.
    during = await ordinary(client, "during")
    assert during.completed is not None and during.token_ids == [0, 1, 2, 3]
    # a goes on past its own stream's cap.
    a = streams[0]
    await a.write(window("a-flood", 7, MIB), window("a-flood", 8, MIB))
    await a.barrier()
    refused = a.first_error("a-flood")
    assert (refused.code_name, refused.field) == ("RESOURCE_EXHAUSTED", "inputs")
    assert "max_input_bytes" in refused.message
    assert budget.held <= PER_PROCESS
    # The flooding streams close: b's request never sent its last window.
    for stream in streams:
        await stream.close()
    b_end = streams[1].first_error("b-flood")
    assert (b_end.code_name, b_end.field) == ("INVALID_ARGUMENT", "submit.is_last")
    assert budget.held == 0
    # Afterwards a large request passes: the budget came back.
    call = client.open_stream()
    await call.write(window("big", 0, 4 * MIB))
    await call.write(window("big", 1, 3 * MIB, last=True))
    await call.done_writing()
    big = (await collect(call))["big"]
    assert big.error is None and big.completed is not None
    assert budget.held == 0


async def test_unfinished_chunks_count_against_the_process_cap(stage) -> None:
    server, client = stage
    budget = server.runtime.budget
    streams = [Stream(client, name) for name in ("a", "b", "c")]
    total = 7 * MIB
    for stream in streams:
        first = tensor_pb2.TensorChunk(
            chunk_id=f"{stream.name}-chunks", offset=0, data=bytes(MIB), total=total
        )
        await stream.write(stage_pb2.StageInput(chunk=first))
        await stream.barrier()
        assert budget.held <= PER_PROCESS
    assert budget.held == 14 * MIB  # declared totals of a and b; c's was refused
    c = streams[2]
    assert c.errors[0].code_name == "RESOURCE_EXHAUSTED"
    assert "max_process_input_bytes" in c.errors[0].message
    # The rest of c's tensor is dropped quietly; its Submit learns why it was refused.
    rest = tensor_pb2.TensorChunk(chunk_id="c-chunks", offset=MIB, data=bytes(MIB), total=total)
    ref = tensor_pb2.Tensor(
        name="x",
        dtype="uint8",
        shape=[total],
        chunked=tensor_pb2.ChunkRef(chunk_id="c-chunks", nbytes=total),
    )
    submit = stage_pb2.Submit(
        request_id="c-req", is_last=True, inputs=stage_pb2.StageInputs(tensors=[ref])
    )
    await c.write(stage_pb2.StageInput(chunk=rest), stage_pb2.StageInput(submit=submit))
    await c.barrier()
    refused = c.first_error("c-req")
    assert (refused.code_name, refused.field) == ("RESOURCE_EXHAUSTED", "inputs.tensors[0]")
    assert len([e for e in c.errors if e.request_id == ""]) == 1  # one refusal, not per chunk
    during = await ordinary(client, "during")
    assert during.completed is not None and during.token_ids == [0, 1, 2, 3]
    for stream in streams:
        await stream.close()
    assert budget.held == 0


async def test_a_request_keeps_a_bounded_number_of_windows(stage) -> None:
    server, client = stage
    stream = Stream(client, "w")
    await stream.write(*(window("many", i, 1) for i in range(MAX_WINDOWS + 5)))
    await stream.barrier()
    refused = stream.first_error("many")
    assert (refused.code_name, refused.field) == ("RESOURCE_EXHAUSTED", "inputs")
    assert f"at most {MAX_WINDOWS}" in refused.message and "max_input_windows" in refused.message
    assert server.runtime.budget.held == 0  # the refused request gave its windows back
    await stream.write(chat("after", "hello", max_tokens=4))
    results = await stream.close()
    assert results["after"].token_ids == [0, 1, 2, 3]
