"""Bad input on a Generate stream: each decodable message gets one final event
for its id and the stream and its other requests go on; a frame that is not a
StageInput at all ends the RPC with INVALID_ARGUMENT."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest

from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.rpc.stage_client import StageClient
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from tests.helpers.stage import cancel, chat


@pytest.fixture(scope="module")
async def stage(tmp_path_factory: pytest.TempPathFactory):
    config = {
        "name": "scripted",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path_factory.mktemp("cache")),
        "runtime": {"max_batch_size": 8},
        "segmenting": {"max_segment_tokens": 1, "min_flush_interval_ms": 0},
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=30)
        yield server, client
    await server.stop(1.0)


def window(rid: str, seq: int, last: bool, text: str = "") -> stage_pb2.StageInput:
    submit = stage_pb2.Submit(request_id=rid, sequence=seq, is_last=last)
    submit.inputs.text = text
    return stage_pb2.StageInput(submit=submit)


class Outputs:
    def __init__(self, outputs: list[stage_pb2.StageOutput]) -> None:
        self.outputs = outputs
        self.finals: Counter[str] = Counter()
        self.errors: dict[str, stage_pb2.Error] = {}
        self.completed: dict[str, stage_pb2.Completed] = {}
        for output in outputs:
            kind = output.WhichOneof("kind")
            if kind == "error":
                self.finals[output.error.request_id] += 1
                self.errors[output.error.request_id] = output.error
            elif kind == "completed":
                self.finals[output.completed.request_id] += 1
                self.completed[output.completed.request_id] = output.completed


async def until_running(call, rid: str) -> stage_pb2.StageOutput:
    output = await call.read()
    assert output.WhichOneof("kind") == "segment" and output.segment.request_id == rid
    return output


async def rest(call, first: list[stage_pb2.StageOutput] = ()) -> Outputs:  # type: ignore[assignment]
    outputs = list(first)
    while (output := await call.read()) is not grpc.aio.EOF:
        outputs.append(output)
    assert await call.code() == grpc.StatusCode.OK  # the stream itself went on to its end
    return Outputs(outputs)


@pytest.mark.parametrize(
    "frame",
    [
        b"\xff\xff\xff\xff",
        stage_pb2.StageInput(submit=stage_pb2.Submit(request_id="cut")).SerializeToString()[:-2],
        stage_pb2.StageInput(submit=stage_pb2.Submit(request_id="abc"))
        .SerializeToString()
        .replace(b"abc", b"\xff\xfe\xfd"),
    ],
    ids=["garbage", "truncated", "non-utf8"],
)
async def test_an_undecodable_frame_ends_the_rpc_with_invalid_argument(stage, frame) -> None:
    _server, client = stage
    raw = client.channel.stream_stream(
        "/omni.v1.Stage/Generate",
        request_serializer=lambda data: data,
        response_deserializer=stage_pb2.StageOutput.FromString,
    )
    call = raw()
    await call.write(chat("held", "hold").SerializeToString())
    await until_running(call, "held")
    await call.write(frame)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "StageInput" in failed.value.details() and "google." not in failed.value.details()


async def test_a_shape_that_overflows_int64_fails_only_its_request(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    for seq in range(3):
        message = window("huge", seq, seq == 2)
        message.submit.inputs.tensors.append(
            tensor_pb2.Tensor(name="x", dtype="float32", shape=[1 << 62, 0])
        )
        await call.write(message)
    await call.write(chat("good", "hello", max_tokens=3))
    await call.done_writing()
    got = await rest(call)
    assert got.errors["huge"].code_name == "INVALID_ARGUMENT"
    assert got.errors["huge"].field == "inputs.tensors.x" and "int64" in got.errors["huge"].message
    assert got.completed["good"].usage.completion_tokens == 3
    assert got.finals == {"huge": 1, "good": 1}


async def test_a_duplicate_submit_while_running_gives_one_final_event(stage) -> None:
    server, client = stage
    call = client.open_stream()
    await call.write(chat("dup", "hold"))
    first = await until_running(call, "dup")
    await call.write(chat("dup", "hello"))
    await call.write(chat("other", "hello", max_tokens=2))
    await call.done_writing()
    got = await rest(call, [first])
    assert got.finals == {"dup": 1, "other": 1}
    assert got.errors["dup"].code_name == "INVALID_ARGUMENT"
    assert got.errors["dup"].field == "submit.request_id"
    assert "other" in got.completed and server.runtime.in_flight == 0


async def test_a_window_after_is_last_gives_one_final_event(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    await call.write(chat("ended", "hold"))
    first = await until_running(call, "ended")
    await call.write(window("ended", 1, True, "more"))
    await call.done_writing()
    got = await rest(call, [first])
    assert got.finals == {"ended": 1}
    error = got.errors["ended"]
    assert error.code_name == "INVALID_ARGUMENT" and error.field == "submit.sequence"
    assert "is_last" in error.message


async def test_windows_zero_one_zero_are_refused_and_their_windows_dropped(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    await call.write(window("w", 0, False, "a b "))
    await call.write(window("w", 1, False, "c d "))
    await call.write(window("w", 0, False, "e "))
    await call.write(window("w", 0, True, "x y z"))  # after its final event: a new request
    await call.done_writing()
    got = await rest(call)
    (error,) = [o.error for o in got.outputs if o.WhichOneof("kind") == "error"]
    assert error.request_id == "w" and error.code_name == "INVALID_ARGUMENT"
    assert error.field == "submit.request_id" and "already in flight" in error.message
    assert got.completed["w"].usage.prompt_tokens == 3  # nothing of the refused windows


async def test_a_cancel_of_an_unknown_id_is_not_found(stage) -> None:
    _server, client = stage
    call = client.open_stream()
    await call.write(cancel("nobody"))
    await call.write(chat("good", "hello", max_tokens=2))
    await call.done_writing()
    got = await rest(call)
    assert got.errors["nobody"].code_name == "NOT_FOUND"
    assert got.errors["nobody"].field == "cancel.request_id"
    assert got.finals == {"nobody": 1, "good": 1}


async def test_a_submit_for_an_id_running_on_another_stream_leaves_it_alone(stage) -> None:
    _server, client = stage
    first_call = client.open_stream()
    await first_call.write(chat("shared", "hold"))
    first = await until_running(first_call, "shared")
    second = await rest_of(client, chat("shared", "hello"))
    assert second.errors["shared"].field == "submit.request_id"
    assert "another stream" in second.errors["shared"].message
    await first_call.write(cancel("shared"))
    await first_call.done_writing()
    got = await rest(first_call, [first])
    assert got.errors["shared"].code_name == "CANCELLED" and got.finals == {"shared": 1}


async def rest_of(client: StageClient, message: stage_pb2.StageInput) -> Outputs:
    call = client.open_stream()
    await call.write(message)
    await call.done_writing()
    return await rest(call)
