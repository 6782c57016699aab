"""The bytes path at the real chunk size, over a real gRPC stage: tensors of odd
sizes (not a multiple of the chunk, one byte over, empty, non-contiguous) go to
a stage as TensorChunks cut from their own memory, are assembled and decoded
there, echoed back the same way, and come back bit for bit."""

from __future__ import annotations

import pytest
import torch

from services.mesh.data.chunk_wire import STAGE_INPUT_CHUNK
from services.mesh.data.chunks import CHUNK_BYTES, ChunkAssembler
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors.transport import TensorReceiver, TensorSender, TransportPolicy
from services.stage.config import parse_stage_config
from services.stage.server import StageServer

SAMPLES = {
    "odd": torch.randint(0, 256, (2 * CHUNK_BYTES + 12345,), dtype=torch.uint8),
    "one_over": torch.randn(CHUNK_BYTES // 4 + 1),
    "exact": torch.randint(0, 256, (2, CHUNK_BYTES), dtype=torch.uint8),
    "strided_bf16": torch.randn(1031, 1025).to(torch.bfloat16).t(),  # 2 MiB + 16 KiB
    "empty": torch.empty(0, 7, dtype=torch.float16),
    "small": torch.arange(10, dtype=torch.int64),
}


def chunk_input() -> tuple[stage_pb2.StageInput, tensor_pb2.TensorChunk]:
    message = stage_pb2.StageInput()
    return message, message.chunk


@pytest.mark.parametrize("encoding", ["protobuf", "by hand"])
async def test_odd_tensors_round_trip_exactly_through_chunks(encoding: str) -> None:
    # The stage reads chunks as protobuf writes them (another client) and as the
    # mesh writes them by hand (chunk_wire); it answers with its own hand-written ones.
    assert not SAMPLES["strided_bf16"].is_contiguous()
    config = {
        "name": "echo",
        "engine": "tests.helpers.echo_tensors:EchoTensorsEngine",
        "load_format": "dummy",
        "runtime": {"torch_threads": 1},
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    sender = TensorSender("bytes", TransportPolicy(), shm=None, cuda=None, chunk_bytes=CHUNK_BYTES)
    submit = stage_pb2.Submit(request_id="odd", is_last=True)
    for name, tensor in SAMPLES.items():
        submit.inputs.tensors.append(sender.encode(tensor, name, "odd", None))
    kinds = {t.name: t.WhichOneof("data") for t in submit.inputs.tensors}
    assert kinds == {
        "odd": "chunked",
        "one_over": "chunked",
        "exact": "chunked",
        "strided_bf16": "chunked",
        "empty": "raw",
        "small": "raw",
    }
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=60)
            call = client.open_stream()
            sent = 0
            for msg in submit.inputs.tensors:
                unsent = sender.take_unsent(msg)
                if unsent is None:
                    continue
                if encoding == "by hand":
                    for frame in unsent.frames(STAGE_INPUT_CHUNK):
                        wire = frame.encode()
                        assert stage_pb2.StageInput.FromString(wire).chunk.data == frame.data
                        assert len(wire) < 4 << 20  # fits a default gRPC client
                        await call.write(frame)
                        sent += 1
                    continue
                for message in unsent.messages(chunk_input):
                    assert message.ByteSize() < 4 << 20  # fits a default gRPC client
                    await call.write(message)
                    sent += 1
            # ceil(size / CHUNK_BYTES) each, no empty tail on the exact multiple
            big = [t for name, t in SAMPLES.items() if kinds[name] == "chunked"]
            assert sent == sum(-(-t.numel() * t.element_size() // CHUNK_BYTES) for t in big)
            await call.write(stage_pb2.StageInput(submit=submit))
            await call.done_writing()
            assembler = ChunkAssembler(1 << 30)
            receiver = TensorReceiver("bytes", allow_refs=False)
            back: dict[str, torch.Tensor] = {}
            async for output in call:
                kind = output.WhichOneof("kind")
                if kind == "chunk":
                    assert len(output.chunk.data) <= CHUNK_BYTES
                    assembler.add(output.chunk)
                elif kind == "segment":
                    for i, t in enumerate(output.segment.tensors):
                        where = f"tensors[{i}]"
                        back[t.name] = receiver.decode(t, where, assembler, request_id="odd")
                elif kind == "error":
                    raise AssertionError(output.error.message)
    finally:
        await server.stop(1.0)
    assert assembler.pending_bytes == 0
    assert back.keys() == SAMPLES.keys()
    for name, tensor in SAMPLES.items():
        got = back[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
