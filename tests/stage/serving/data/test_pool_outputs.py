"""An engine that generates into the stage's pooled shared blocks (the frame
source), over a real gRPC stage: a consumer on this node gets refs to the very
blocks the frames were drawn in (no copy), one elsewhere gets bytes, and the
blocks come back to the pool either way."""

from __future__ import annotations

import gc

import torch

from services.engines.video.source import pattern_frames
from services.mesh.data.node import node_identity
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from services.mesh.tensors.transport import TensorReceiver
from services.stage.config import parse_stage_config
from services.stage.server import StageServer

FRAMES, WINDOW, SIDE = 8, 4, 256  # 768 KiB a window: a 1 MiB pooled block each


def submit(request_id: str, seed: int, *, here: bool) -> stage_pb2.Submit:
    msg = stage_pb2.Submit(request_id=request_id, is_last=True)
    msg.inputs.text = "go"
    msg.params.seed = seed
    if here:
        msg.consumer.CopyFrom(node_identity())
    return msg


async def test_frames_are_drawn_in_pool_blocks_and_sent_without_a_copy() -> None:
    config = {
        "name": "frames",
        "engine": "video_frames",
        "load_format": "dummy",
        "engine_args": {"frames": FRAMES, "window_frames": WINDOW, "height": SIDE, "width": SIDE},
        "runtime": {"torch_threads": 1},
    }
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    receiver = TensorReceiver("default", allow_refs=True)
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=60)
            shipped = [
                t
                async for out in client.generate(submit("near", 5, here=True))
                if out.WhichOneof("kind") == "segment"
                for t in out.segment.tensors
            ]
            assert [t.WhichOneof("data") for t in shipped] == ["shm"] * (FRAMES // WINDOW)
            got = torch.cat([receiver.decode(t, "t", request_id="near") for t in shipped])
            assert torch.equal(got, pattern_frames(FRAMES, SIDE, SIDE, 5))
            stats = server.tensors.sender.stats
            assert stats.in_place == FRAMES // WINDOW  # drawn in the block, never copied
            await client.release_tensors(stage_pb2.ReleaseTensorsRequest(request_id="near"))
            pool = server.tensors.shm.pool if server.tensors.shm else None
            assert pool is not None and pool.free_bytes == (FRAMES // WINDOW) << 20

            # A consumer that cannot map the blocks: bytes, copied out of the same blocks.
            raw = [
                t
                async for out in client.generate(submit("far", 6, here=False))
                if out.WhichOneof("kind") == "segment"
                for t in out.segment.tensors
            ]
            assert [t.WhichOneof("data") for t in raw] == ["raw"] * (FRAMES // WINDOW)
            got = torch.cat([codec.from_proto(t) for t in raw])
            assert torch.equal(got, pattern_frames(FRAMES, SIDE, SIDE, 6))
            assert server.tensors.sender.stats.in_place == stats.in_place
            gc.collect()
            # Never shared, so back in the pool once the stage dropped its views.
            assert pool.free_bytes == (FRAMES // WINDOW) << 20
            assert server.tensors.shm is not None and server.tensors.shm.live_names == []
    finally:
        await server.stop(1.0)
