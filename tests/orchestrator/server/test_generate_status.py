"""A failed request fails its Orchestrator.Generate RPC: after the Done, the RPC
ends with the Done's code and message, and its stage and field ride in trailing
metadata, so grpcurl, proxies and dashboards count the failure. GenerateStream
carries several requests and ends OK. Our clients still hand over the Done."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrator.client import Client
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.testing.configs import tiny_config
from tests.helpers.grpcurl import GRPCURL, json_stream
from tests.orchestrator.conftest import Stages, orchestrator, pipeline

METHOD_STREAM = "omni.v1.Orchestrator/GenerateStream"
THINK_TO_TALK = [{"from": "thinker", "to": "talker", "transform": "tokens"}]


@pytest.fixture(scope="module")
async def two_stages(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[Stages]:
    stages = Stages(tmp_path_factory.mktemp("status"))
    runtime = {"torch_threads": 1, "max_batch_size": 1}
    try:
        await stages.start(
            {
                name: tiny_config(name, omni_cache_dir, runtime=runtime)
                for name in ("thinker", "talker")
            }
        )
        yield stages
    finally:
        await stages.stop()


def _request(**params: object) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        inputs=stage_pb2.StageInputs(messages=[stage_pb2.ChatMessage(role="user", content="Hi")]),
        params=stage_pb2.GenerationParams(**params),
    )


async def _raw(
    address: str, request: orchestrator_pb2.GenerateRequest
) -> tuple[list[orchestrator_pb2.GenerateEvent], grpc.aio.AioRpcError | None]:
    """The events of one Generate on a plain gRPC channel, and the error it ended with."""
    events: list[orchestrator_pb2.GenerateEvent] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(
            "/omni.v1.Orchestrator/Generate",
            request_serializer=orchestrator_pb2.GenerateRequest.SerializeToString,
            response_deserializer=orchestrator_pb2.GenerateEvent.FromString,
        )(request, timeout=60)
        try:
            async for event in call:
                events.append(event)
        except grpc.aio.AioRpcError as exc:
            return events, exc
    return events, None


async def test_a_failed_generate_ends_with_its_status_and_trailers(two_stages: Stages) -> None:
    config = pipeline(two_stages, ["thinker", "talker"], THINK_TO_TALK, outputs=["thinker"])
    async with orchestrator(config) as (server, client):
        address = f"127.0.0.1:{server.port}"
        # Refused by the entry stage: the Done, then the same status on the RPC.
        events, error = await _raw(address, _request(temperature=-1.0, max_tokens=4))
        assert [e.WhichOneof("kind") for e in events] == ["done"]
        done = events[0].done
        assert (done.code_name, done.stage, done.field) == (
            "INVALID_ARGUMENT", "thinker", "params.temperature",
        )  # fmt: skip
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == done.message
        trailers = dict(error.trailing_metadata())
        assert trailers == {"stage": "thinker", "field": "params.temperature"}

        # Refused by a later stage, after the thinker's output reached the client.
        late = _request(max_tokens=4)
        late.stage_params["talker"].temperature = -1.0
        events, error = await _raw(address, late)
        kinds = [e.WhichOneof("kind") for e in events]
        assert "segment" in kinds and kinds[-1] == "done", kinds
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(error.trailing_metadata()) == {"stage": "talker", "field": "params.temperature"}

        # Refused by the orchestrator itself: a field a client chose is percent-encoded.
        unknown = _request(max_tokens=4)
        unknown.stage_params["nöbody"].max_tokens = 1
        events, error = await _raw(address, unknown)
        assert events[-1].done.field == "stage_params.nöbody"
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(error.trailing_metadata()) == {"field": "stage_params.n%C3%B6body"}

        # A request that succeeds ends OK.
        events, error = await _raw(address, _request(max_tokens=4))
        assert error is None and events[-1].done.code_name == "OK"

        # Our clients hand over the Done and end quietly, as before.
        result = await client.generate("Hi", params={"temperature": -1.0}).collect()
        assert result.done.code_name == "INVALID_ARGUMENT" and result.done.stage == "thinker"
        with Client(address) as sync:
            refused = await asyncio.to_thread(sync.collect, "Hi", params={"temperature": -1.0})
        assert refused.done.code_name == "INVALID_ARGUMENT" and refused.done.stage == "thinker"


async def test_grpcurl_exits_with_the_failed_requests_code(two_stages: Stages) -> None:
    config = pipeline(two_stages, ["thinker"], [])
    async with orchestrator(config) as (server, _client):
        address = f"127.0.0.1:{server.port}"

        def generate(params: dict[str, object]) -> subprocess.CompletedProcess[str]:
            body = {"inputs": {"messages": [{"role": "user", "content": "Hi"}]}, "params": params}
            command = [GRPCURL, "-plaintext", "-v", "-max-time", "60", "-d", json.dumps(body)]
            return subprocess.run(
                [*command, address, "omni.v1.Orchestrator/Generate"],
                capture_output=True,
                text=True,
                timeout=90,
            )

        failed = await asyncio.to_thread(generate, {"temperature": -1, "max_tokens": 4})
        # grpcurl exits 64 + the status code; the Done is still printed.
        assert failed.returncode == 64 + grpc.StatusCode.INVALID_ARGUMENT.value[0], failed.stderr
        assert "Code: InvalidArgument" in failed.stderr
        assert "params.temperature" in failed.stderr
        assert "field: params.temperature" in failed.stdout  # the trailers, with -v
        assert "stage: thinker" in failed.stdout
        ok = await asyncio.to_thread(generate, {"max_tokens": 4})
        assert ok.returncode == 0, ok.stderr
        assert '"code_name": "OK"' in ok.stdout


async def test_generate_stream_keeps_per_request_dones_and_ends_ok(two_stages: Stages) -> None:
    config = pipeline(two_stages, ["thinker"], [])
    async with orchestrator(config) as (server, _client):
        messages = [
            {"submit": {"requestId": rid, "isLast": True, "inputs": {"text": "Hi"}, "params": p}}
            for rid, p in (("bad", {"temperature": -1}), ("good", {"maxTokens": 4}))
        ]
        address = f"127.0.0.1:{server.port}"
        stream = await asyncio.to_thread(
            subprocess.run,
            [GRPCURL, "-plaintext", "-max-time", "60", "-d", "@", address, METHOD_STREAM],
            input="\n".join(json.dumps(m) for m in messages),
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert stream.returncode == 0, stream.stderr
        events = json_stream(stream.stdout)
        dones = {e["done"]["request_id"]: e["done"] for e in events if "done" in e}
        assert dones["bad"]["code_name"] == "INVALID_ARGUMENT"
        assert dones["good"]["code_name"] == "OK"
