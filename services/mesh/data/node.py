"""Where this process runs: enough for a consumer to tell which tensor refs it can open."""

from __future__ import annotations

import functools
import os
import socket
import sys
from pathlib import Path
from typing import Any

from services.mesh import environment
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
    # A process that has not imported torch (the orchestrator) holds no GPU
    # tensors: it must not pay for importing torch just to say so.
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [gpu_uuid(torch, i) for i in range(torch.cuda.device_count())]


def gpu_uuid(torch: Any, index: int) -> str:
    """The UUID of local CUDA device ``index`` as nvidia-smi and NodeIdentity spell it
    (``torch`` the imported module: this half of the data plane never imports it)."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


@functools.cache
def node_identity() -> tensor_pb2.NodeIdentity:
    return tensor_pb2.NodeIdentity(
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        hostname=socket.gethostname(),
        k8s_node_name=environment.NODE_NAME.get(),
        ipc_namespace=_namespace("ipc"),
        pid_namespace=_namespace("pid"),
        gpu_uuids=_gpu_uuids(),
    )


def mesh_id() -> str:
    """This mesh instance's id ($OMNI_MESH_ID): the prefix of every shared block it owns."""
    return environment.MESH_ID.get()


def same_node(a: tensor_pb2.NodeIdentity, b: tensor_pb2.NodeIdentity) -> bool:
    # An empty boot id means "unknown", never "equal": a ref to memory we cannot
    # prove is ours would read another machine's block of the same name.
    if not a.boot_id or a.boot_id != b.boot_id or a.hostname != b.hostname:
        return False
    if a.k8s_node_name and b.k8s_node_name:
        return a.k8s_node_name == b.k8s_node_name
    return True


def same_ipc(a: tensor_pb2.NodeIdentity, b: tensor_pb2.NodeIdentity) -> bool:
    """Whether ``b`` sees the /dev/shm and IPC objects ``a`` creates."""
    return same_node(a, b) and bool(a.ipc_namespace) and a.ipc_namespace == b.ipc_namespace


def shared_gpu(
    producer: tensor_pb2.NodeIdentity, consumer: tensor_pb2.NodeIdentity, device_uuid: str
) -> bool:
    """Whether both processes, on one node, see the GPU ``device_uuid``."""
    return (
        bool(device_uuid)
        and same_node(producer, consumer)
        and device_uuid in producer.gpu_uuids
        and device_uuid in consumer.gpu_uuids
    )
