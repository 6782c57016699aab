"""Where this process runs: enough for a consumer to tell which tensor refs it can open."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

from services.mesh.pb.omni.v1 import tensor_pb2


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def _gpu_uuids() -> list[str]:
    # Only ask torch when CUDA is already usable: initialising CUDA in a CPU
    # process would cost seconds and memory for nothing.
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(count)]


@functools.cache
def node_identity() -> tensor_pb2.NodeIdentity:
    return tensor_pb2.NodeIdentity(
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        hostname=socket.gethostname(),
        k8s_node_name=os.environ.get("OMNI_NODE_NAME", os.environ.get("NODE_NAME", "")),
        ipc_namespace=_namespace("ipc"),
        pid_namespace=_namespace("pid"),
        gpu_uuids=_gpu_uuids(),
    )
