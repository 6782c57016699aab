"""Reading one frame of Stage.Generate: the stage server's request deserializer.

A TensorChunk is read by hand (its payload stays a view of the frame,
``chunk_wire``); anything else goes to protobuf. A frame that does not decode
becomes an ``UndecodableInput`` value the stream answers with INVALID_ARGUMENT,
never an exception gRPC would report as UNKNOWN.
"""

from __future__ import annotations

from services.mesh.data.chunk_wire import STAGE_INPUT_CHUNK, ChunkFrame, decode_chunk
from services.mesh.pb.omni.v1 import stage_pb2


class UndecodableInput:
    """What the request deserializer gives for a frame that is no StageInput."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def read_input(frame: bytes) -> stage_pb2.StageInput | ChunkFrame | UndecodableInput:
    """Generate's request deserializer: a chunk is read by hand (its payload a view
    of the frame, ``chunk_wire``); a bad frame becomes a value the stream answers
    with INVALID_ARGUMENT, not an exception gRPC reports as UNKNOWN."""
    chunk = decode_chunk(frame, STAGE_INPUT_CHUNK)
    if chunk is not None:
        return chunk
    try:
        return stage_pb2.StageInput.FromString(frame)
    except Exception as exc:  # DecodeError, bad UTF-8 in a string field, …
        return UndecodableInput(str(exc) or "malformed protobuf")
