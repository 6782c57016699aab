"""The stage's data plane over real gRPC: shared-memory outputs for a consumer on
this node, refs validated on input, chunked tensors in and out."""

from __future__ import annotations

import io
import logging
import os
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.data import chunks
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.data.node import mesh_id, node_identity
from services.mesh.data.shm_dir import mesh_dir
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from services.mesh.tensors.shm import ShmProducer
from services.mesh.tensors.transport import TensorReceiver
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.stage.serving.tensor_io import StageTensors
from services.testing.configs import tiny_config
from tests.helpers.shm_blocks import blocks_of, remove_mesh
from tests.helpers.stage import chat, collect
from tests.mesh.test_shm import made_name


def blocks() -> set[str]:
    return set(blocks_of("default"))


@pytest.fixture(scope="module")
async def thinker(omni_cache_dir: Path, smollm2_gguf: Path):
    config = tiny_config("thinker", omni_cache_dir, runtime={"inline_max_bytes": 0})
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=120)
        yield client
    await server.stop(1.0)


async def test_outputs_go_by_shared_memory_to_a_consumer_on_this_node(thinker) -> None:
    plain = chat("raw", "Hi", max_tokens=5, seed=1, return_hidden_states=True).submit
    by_ref = chat("ref", "Hi", max_tokens=5, seed=1, return_hidden_states=True).submit
    by_ref.consumer.CopyFrom(node_identity())
    raw = (await collect(thinker.generate(plain)))["raw"]
    before = blocks()
    shared = (await collect(thinker.generate(by_ref)))["ref"]
    refs = [t for s in shared.segments for t in s.tensors]
    assert refs and all(t.WhichOneof("data") == "shm" for t in refs)
    assert all(t.WhichOneof("data") == "raw" for s in raw.segments for t in s.tensors)
    receiver = TensorReceiver("default", allow_refs=True)
    opened = torch.cat([receiver.decode(t, "t", request_id="ref") for t in refs])
    expected = torch.cat([codec.from_proto(t) for s in raw.segments for t in s.tensors])
    assert torch.equal(opened, expected)
    assert {t.shm.name for t in refs} <= blocks() - before
    reply = await thinker.stub.ReleaseTensors(stage_pb2.ReleaseTensorsRequest(request_id="ref"))
    assert reply.released == len({t.shm.name for t in refs})
    assert blocks() <= before


@pytest.mark.parametrize(
    ("name", "offset", "code", "field"),
    [
        (made_name("othermesh", "bad-ref"), 0, "FAILED_PRECONDITION", "inputs.tensors[0].shm.name"),
        ("../../etc/passwd", 0, "INVALID_ARGUMENT", "inputs.tensors[0].shm.name"),
        (made_name("default", "bad-ref"), 0, "FAILED_PRECONDITION", "inputs.tensors[0].shm.name"),
        (made_name("default", "another"), 0, "FAILED_PRECONDITION", "inputs.tensors[0].shm.name"),
    ],
)
async def test_refs_that_cannot_be_opened_here_are_refused(thinker, name, offset, code, field):
    submit = chat("bad-ref", "Hi", max_tokens=2).submit
    tensor = submit.inputs.tensors.add(name="prompt_embeds", dtype="float32", shape=[1, 64])
    tensor.shm.name, tensor.shm.offset, tensor.shm.nbytes = name, offset, 256
    tensor.shm.producer.CopyFrom(node_identity())
    error = (await collect(thinker.generate(submit)))["bad-ref"].error
    assert error is not None and error.code_name == code
    if field:
        assert error.field == field


async def test_a_chunked_tensor_without_its_chunks_is_refused_by_field(thinker) -> None:
    submit = chat("lost", "Hi", max_tokens=2).submit
    tensor = submit.inputs.tensors.add(name="prompt_embeds", dtype="float32", shape=[1, 64])
    tensor.chunked.chunk_id, tensor.chunked.nbytes = "nowhere", 256
    error = (await collect(thinker.generate(submit)))["lost"].error
    assert error.code_name == "INVALID_ARGUMENT" and error.field.startswith("inputs.tensors")


@pytest.fixture(scope="module")
async def big_renderer():
    config = {
        "name": "renderer",
        "engine": "diffusers",
        "load_format": "dummy",
        "engine_args": {"sample_size": 32, "num_inference_steps": 1},
        "runtime": {"chunk_bytes": 4096},  # the 12 KiB image leaves in 3 chunks
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    async with StageClient(f"127.0.0.1:{port}") as client:
        await client.wait_ready(timeout_s=120)
        yield client
    await server.stop(1.0)


async def test_large_tensors_travel_in_chunks_both_ways(big_renderer) -> None:
    call = big_renderer.open_stream()
    submit = stage_pb2.Submit(request_id="big", is_last=True)
    embeds = torch.randn(8, 32)
    submit.inputs.tensors.append(codec.to_proto(embeds, "prompt_embeds"))
    pieces = chunks.split(submit.inputs.tensors, threshold=256)  # 1 KiB in 4 chunks
    assert len(pieces) == 4
    for piece in pieces:
        await call.write(stage_pb2.StageInput(chunk=piece))
    await call.write(stage_pb2.StageInput(submit=submit))
    await call.done_writing()
    outputs = []
    while (output := await call.read()) is not None and output.WhichOneof("kind"):
        outputs.append(output)
        if output.WhichOneof("kind") in ("completed", "error"):
            break
    kinds = [o.WhichOneof("kind") for o in outputs]
    assert kinds.count("chunk") >= 2 and kinds[-2:] == ["segment", "completed"]
    assembler = ChunkAssembler(64 << 20)
    for output in outputs:
        if output.WhichOneof("kind") == "chunk":
            assembler.add(output.chunk)
    segment = outputs[-2].segment
    assembler.resolve(segment.tensors, "segment.tensors")
    assert codec.from_proto(segment.tensors[0]).shape == (64, 64, 3)


async def test_a_chunked_image_is_reassembled_for_an_orchestrator_client(big_renderer) -> None:
    pipeline = parse_pipeline(
        {"name": "big", "stages": [{"name": "renderer", "address": big_renderer.address}]}, "big"
    )
    server = OrchestratorServer(pipeline, chunk_bytes=4096)
    port = await server.start("127.0.0.1", 0)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=60)
            request = client.generate(
                inputs=stage_pb2.StageInputs(text="a"), params={"return_png": True, "seed": 2}
            )
            result = await request.collect()
    finally:
        await server.stop(1.0)
    assert result.ok, result.done
    (image,) = result.stages["renderer"].tensors["image"]
    pixels = codec.from_proto(image)
    assert pixels.shape == (64, 64, 3)
    (blob,) = result.stages["renderer"].blobs
    assert blob.WhichOneof("payload") == "data" and len(blob.data) > 4096  # it came in chunks
    assert torch.equal(torch.from_numpy(np.array(Image.open(io.BytesIO(blob.data)))), pixels)


async def test_a_large_png_leaves_the_stage_in_chunks(big_renderer) -> None:
    submit = stage_pb2.Submit(request_id="png", is_last=True)
    submit.inputs.text = "a"
    submit.params.return_png = True
    call = big_renderer.open_stream()
    await call.write(stage_pb2.StageInput(submit=submit))
    await call.done_writing()
    assembler = ChunkAssembler(64 << 20)
    segment = None
    while (output := await call.read()) is not grpc.aio.EOF:
        if output.WhichOneof("kind") == "chunk":
            assembler.add(output.chunk)
        elif output.WhichOneof("kind") == "segment":
            segment = output.segment
    assert segment is not None and segment.blobs[0].WhichOneof("payload") == "chunked"
    assert segment.ByteSize() < 4096  # no message carries the PNG whole
    assembler.resolve_blobs(segment.blobs, "segment.blobs")
    assembler.resolve(segment.tensors, "segment.tensors")
    png = Image.open(io.BytesIO(segment.blobs[0].data))
    assert png.size == (64, 64)
    pixels = torch.from_numpy(np.array(png))
    assert torch.equal(pixels, codec.from_proto(segment.tensors[0]))


async def test_windows_of_shared_blocks_reach_a_stage_without_streaming_input(
    big_renderer,
) -> None:
    """A windowed edge carrying refs into a stage that joins windows first."""
    producer = ShmProducer(mesh_id(), ttl_s=60)
    embeds = torch.randn(7, 32)
    call = big_renderer.open_stream()
    try:
        for seq, (start, stop) in enumerate([(0, 3), (3, 4), (4, 7)]):
            submit = stage_pb2.Submit(request_id="win", sequence=seq, is_last=stop == 7)
            piece = producer.put(embeds[start:stop].contiguous(), "win")
            piece.name = "prompt_embeds"
            submit.inputs.tensors.append(piece)
            await call.write(stage_pb2.StageInput(submit=submit))
        await call.done_writing()
        result = (await collect(call))["win"]
    finally:
        producer.close()
    assert result.error is None, result.error
    assert result.completed.usage.prompt_tokens == 7  # every window's rows, joined


def test_a_shm_directory_open_to_others_turns_shared_memory_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    mesh = f"t{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("OMNI_MESH_ID", mesh)
    folder = mesh_dir(mesh)
    folder.mkdir()
    folder.chmod(0o777)  # made first by someone else, for us to write into
    try:
        config = {"name": "s", "engine": "transformers", "load_format": "dummy"}
        with caplog.at_level(logging.ERROR, logger="services.stage.serving.tensor_io"):
            tensors = StageTensors(parse_stage_config(config))
        assert tensors.shm is None
        assert "shared memory off" in caplog.text and "not private" in caplog.text
        msg = tensors.encode(torch.zeros(1 << 16), "hidden_states", "r", node_identity())
        assert msg.WhichOneof("data") == "raw"  # 256 KiB to a consumer here: bytes
        assert tensors.sender.stats.fallbacks == {"shm disabled": 1}
        assert os.listdir(folder) == []
    finally:
        remove_mesh(mesh)
