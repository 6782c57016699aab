"""A frame that is not the method's request message, on any method of either
server, ends that RPC with INVALID_ARGUMENT naming the message (never UNKNOWN
with a Python class name), and the server goes on serving."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.stage.config import parse_stage_config
from services.stage.server import StageServer

TRUNCATED = b"\xff\xff\xff"  # not protobuf at all
BAD_UTF8 = b"\x0a\x05\x0a\x03\xff\xfe\xfd"  # field 1: bad UTF-8 where a string is
# StageInput.chunk frames the hand decoder (chunk_wire) turns away: the regular
# parser refuses them too. Bad UTF-8 in chunk_id; a payload running past the frame.
BAD_CHUNK_ID = b"\x1a\x05\x0a\x03\xff\xfe\xfd"
CUT_CHUNK = b"\x1a\x07\x0a\x01x\x1a\x09ab"


@pytest.fixture(scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, str]]:
    config = {
        "name": "scripted",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path_factory.mktemp("cache")),
    }
    stage = StageServer(parse_stage_config(config))
    stage_port = await stage.start("127.0.0.1", 0)
    pipeline = parse_pipeline(
        {"name": "frames", "stages": [{"name": "scripted", "address": f"127.0.0.1:{stage_port}"}]}
    )
    orchestrator = OrchestratorServer(pipeline)
    port = await orchestrator.start()
    try:
        await orchestrator.wait_ready(60)
        yield f"127.0.0.1:{port}", f"127.0.0.1:{stage_port}"
    finally:
        await orchestrator.stop(1.0)
        await stage.stop(1.0)


async def call(channel: grpc.aio.Channel, path: str, kind: str, frame: bytes) -> None:
    if kind == "unary":
        await channel.unary_unary(path)(frame)
    elif kind == "server-stream":
        _ = [reply async for reply in channel.unary_stream(path)(frame)]
    else:
        stream = channel.stream_stream(path)()
        await stream.write(frame)
        await stream.done_writing()
        _ = [reply async for reply in stream]


@pytest.mark.parametrize(
    ("server", "method", "kind", "message"),
    [
        (0, "omni.v1.Orchestrator/Generate", "server-stream", "omni.v1.GenerateRequest"),
        (0, "omni.v1.Orchestrator/GenerateStream", "bidi", "omni.v1.StreamInput"),
        (0, "omni.v1.Orchestrator/Abort", "unary", "omni.v1.AbortRequest"),
        # Field 1 is unknown to an empty message: that frame is a valid DescribeRequest.
        (1, "omni.v1.Stage/Describe", "unary", "omni.v1.DescribeRequest"),
        (1, "omni.v1.Stage/ReleaseTensors", "unary", "omni.v1.ReleaseTensorsRequest"),
        (1, "omni.v1.Stage/Generate", "bidi", "StageInput"),
    ],
)
async def test_an_undecodable_frame_is_invalid_argument(
    servers: tuple[str, str], server: int, method: str, kind: str, message: str
) -> None:
    async with grpc.aio.insecure_channel(servers[server]) as channel:
        frames = (TRUNCATED,) if method.endswith("Describe") else (TRUNCATED, BAD_UTF8)
        if method == "omni.v1.Stage/Generate":
            frames += (BAD_CHUNK_ID, CUT_CHUNK)
        for frame in frames:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(channel, f"/{method}", kind, frame)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert message in (err.value.details() or "")
            assert "<class" not in (err.value.details() or "")
    async with StageClient(servers[1]) as stage:  # and the stage goes on serving
        outputs = [o async for o in stage.generate(chat_submit("after", "hi", max_tokens=2))]
    assert outputs[-1].WhichOneof("kind") == "completed"
    assert isinstance(outputs[-1].completed, stage_pb2.Completed)


async def test_streaming_methods_that_write_their_own_replies_still_work(
    servers: tuple[str, str],
) -> None:
    # grpc's aio health Watch is a coroutine writing through context.write, not an
    # async generator: the decoding interceptor must pass its replies through.
    for address in servers:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            first = await watch.read()
            watch.cancel()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
