"""Tensor refs as bytes, for a process that hands them on to a client (the
orchestrator): shm refs are read and pull refs pulled without torch; a CUDA IPC
ref needs torch and a GPU, so only then is the tensor data plane (and torch)
imported. A pull waits on the network: call ``read`` off the event loop."""

from __future__ import annotations

from pathlib import Path

from services.mesh.data.pull import checked_size, pull
from services.mesh.data.shm_dir import SHM_ROOT
from services.mesh.data.shm_refs import read_bytes
from services.mesh.environment import check_mesh_id
from services.mesh.pb.omni.v1 import tensor_pb2

REFS = ("shm", "cuda_ipc", "pull")  # tensor data that names memory of a mesh process


class RefReader:
    def __init__(self, mesh_id: str, root: Path = SHM_ROOT, token: str | None = None) -> None:
        """``token``: the mesh token a pull carries to a stage's data port."""
        self.mesh_id = check_mesh_id(mesh_id)
        self.root = root
        self.token = token

    def read(self, msg: tensor_pb2.Tensor, field: str, request_id: str) -> tensor_pb2.Tensor:
        """``msg``, an output of request ``request_id``, with its ref replaced by the
        bytes it names (validated as a stage would)."""
        kind = msg.WhichOneof("data")
        if kind == "shm":
            return read_bytes(
                msg, mesh_id=self.mesh_id, request_id=request_id, field=field, root=self.root
            )
        if kind == "pull":
            checked_size(msg, field)
            data = pull(msg.pull, field=field, request_id=request_id, token=self.token)
            return tensor_pb2.Tensor(
                name=msg.name, dtype=msg.dtype, shape=msg.shape, raw=bytes(data)
            )
        if kind == "cuda_ipc":
            from services.mesh.tensors import codec
            from services.mesh.tensors.transport import TensorReceiver

            receiver = TensorReceiver(self.mesh_id, allow_refs=True, root=self.root)
            return codec.to_proto(receiver.decode(msg, field, request_id=request_id), msg.name)
        return msg
