"""CUDA tensors handed between processes of one node through torch's own reductions.

torch already solves the hard parts: the producer's caching allocator keeps a
shared block alive until every consumer's reference counter (a small shared file
torch manages) drops to zero, and the consumer waits on the producer's CUDA event
before its first read. We only carry torch's handles in a CudaIpcRef instead of a
pickle. The producer process must outlive the consumers' use of its tensors.

torch.cuda is imported lazily: this module imports and refuses refs cleanly on a
CPU-only machine.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import torch

from services.mesh.data.node import gpu_uuid, node_identity, same_node
from services.mesh.errors import FailedPrecondition, InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec


def ref_name(ref: tensor_pb2.CudaIpcRef) -> str:
    """A short stable name for a shared allocation, for Stage.ReleaseTensors."""
    digest = hashlib.blake2b(ref.handle, digest_size=12)
    digest.update(ref.offset.to_bytes(8, "little"))
    return f"cuda-{digest.hexdigest()}"


class CudaIpcProducer:
    """Keeps shared CUDA tensors alive by request until released."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[str, torch.Tensor]] = {}

    @property
    def live_names(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def share(self, tensor: torch.Tensor, owner: str) -> tensor_pb2.Tensor:
        """A cuda_ipc ref to ``tensor`` (or to a compact copy of it, for views)."""
        from torch.multiprocessing.reductions import reduce_tensor

        if not tensor.is_cuda:
            raise ValueError(f"cuda_ipc shares CUDA tensors, got one on {tensor.device}")
        wire = codec.dtype_name(tensor.dtype)
        source = tensor.detach()
        nbytes = source.numel() * source.element_size()
        # The ref has room for one offset, the storage's: a view into a larger
        # storage (or a strided one) is compacted first, on the GPU.
        if not (
            source.is_contiguous()
            and source.storage_offset() == 0
            and source.untyped_storage().nbytes() == nbytes
        ):
            source = source.clone(memory_format=torch.contiguous_format)
        args = reduce_tensor(source)[1]
        (handle, storage_nbytes, storage_offset) = args[7], args[8], args[9]
        (counter_handle, counter_offset, event_handle, event_sync) = args[11:15]
        ref = tensor_pb2.CudaIpcRef(
            handle=handle or b"",
            device_uuid=gpu_uuid(torch, source.device.index),
            offset=storage_offset,
            nbytes=nbytes,
            ref_counter_handle=counter_handle or b"",
            ref_counter_offset=counter_offset,
            event_handle=event_handle or b"",
            event_sync_required=bool(event_sync),
            storage_nbytes=storage_nbytes,
            producer=node_identity(),
        )
        with self._lock:
            self._held[ref_name(ref)] = (owner, source)
        return tensor_pb2.Tensor(dtype=wire, shape=list(source.shape), cuda_ipc=ref)

    def release(self, owner: str | None = None, names: Iterable[str] = ()) -> int:
        """Drop our references; torch frees each block once its consumers let go."""
        wanted = set(names)
        owner = owner or None  # "" names no request
        with self._lock:
            chosen = [key for key, (who, _) in self._held.items() if key in wanted or who == owner]
            for key in chosen:
                del self._held[key]
        return len(chosen)

    def close(self) -> None:
        with self._lock:
            self._held.clear()


def open_cuda(msg: tensor_pb2.Tensor, *, field: str) -> torch.Tensor:
    """The producer's CUDA tensor, mapped into this process (no copy)."""
    ref = msg.cuda_ipc
    where = f"{field}.cuda_ipc"
    expected = codec.nbytes_of(msg, field)
    dtype = codec.DTYPES[msg.dtype]
    if ref.nbytes != expected or ref.view_offset + ref.nbytes > ref.storage_nbytes:
        raise InvalidArgument(
            f"{where}.nbytes: dtype {msg.dtype} and shape {list(msg.shape)} need {expected} "
            f"bytes, the ref says {ref.nbytes} in a storage of {ref.storage_nbytes}",
            field=f"{where}.nbytes",
        )
    if not ref.HasField("producer"):
        raise InvalidArgument(f"{where}.producer: missing", field=f"{where}.producer")
    here = node_identity()
    if not same_node(ref.producer, here):
        raise FailedPrecondition(f"{where}: the tensor lives on another node", field=where)
    # Devices are matched by UUID: CUDA_VISIBLE_DEVICES may number them differently here.
    if ref.device_uuid not in here.gpu_uuids:
        raise FailedPrecondition(
            f"{where}.device_uuid: this process cannot see GPU {ref.device_uuid[:64]!r}",
            field=f"{where}.device_uuid",
        )
    index = list(here.gpu_uuids).index(ref.device_uuid)
    shape = torch.Size(msg.shape)
    if expected == 0:
        return torch.empty(shape, dtype=dtype, device=f"cuda:{index}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    stride = torch.empty(shape, device="meta").stride()
    # rebuild waits on the producer's event when event_sync_required, and takes
    # a count on torch's shared ref counter so the producer cannot free the block.
    tensor: torch.Tensor = rebuild_cuda_tensor(
        torch.Tensor,
        shape,
        stride,
        ref.view_offset // dtype.itemsize,
        torch.storage.TypedStorage,
        dtype,
        index,
        ref.handle,
        ref.storage_nbytes,
        ref.offset,
        False,
        ref.ref_counter_handle,
        ref.ref_counter_offset,
        ref.event_handle,
        ref.event_sync_required,
    )
    return tensor
