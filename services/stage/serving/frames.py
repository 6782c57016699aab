"""Reading one frame of Stage.Generate: the stage server's request deserializer.

A TensorChunk is read by hand (its payload stays a view of the frame,
``chunk_wire``); anything else goes to protobuf. A frame that is neither raises,
as any deserializer does: the mesh's decoding interceptor
(``services.mesh.rpc.decoding``) turns that into ``UndecodableFrame`` where the
stream reaches it, and the RPC ends INVALID_ARGUMENT naming omni.v1.StageInput.
"""

from __future__ import annotations

from services.mesh.data.chunk_wire import STAGE_INPUT_CHUNK, ChunkFrame, deserializer
from services.mesh.pb.omni.v1 import stage_pb2

InputFrame = stage_pb2.StageInput | ChunkFrame  # what Generate's request iterator yields

read_input = deserializer(STAGE_INPUT_CHUNK, stage_pb2.StageInput.FromString)
