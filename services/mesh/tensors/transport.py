"""The cheapest way a tensor can reach its consumer, and both ends of each way.

    cuda_ipc  a GPU tensor, consumer on the same node, IPC and PID namespace,
              seeing the same GPU: no copy at all
    shm       a CPU tensor (or a GPU tensor the consumer cannot map, copied to
              host) on the same node and IPC namespace: one copy, or none for a
              tensor generated in a pooled block (``ShmProducer.allocate``)
    pull      a tensor of ``pull_min_bytes`` or more that neither can carry
              (another node, another IPC namespace, shared memory off or full):
              held where it is, the consumer reads it from this stage's data
              port (``services.mesh.data.pull``), not through the orchestrator
    raw       anything else, and anything under ``inline_max_bytes``, where a
              ref's bookkeeping costs more than the bytes

Every step down from the best transport for a tensor is a fallback: counted by
reason, and logged once per reason so a misplaced stage shows up in the log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from services.mesh.data import chunks
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.data.node import node_identity, same_ipc, same_node, shared_gpu
from services.mesh.data.pull import checked_size, key_name, pull_into
from services.mesh.data.pull_server import PullServer
from services.mesh.environment import check_mesh_id
from services.mesh.errors import InvalidArgument, ResourceExhausted
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec
from services.mesh.tensors.cuda_ipc import CudaIpcProducer, open_cuda, ref_name
from services.mesh.tensors.shm import SHM_ROOT, ShmProducer, open_tensor

logger = logging.getLogger(__name__)

RAW, SHM, CUDA_IPC, PULL = "raw", "shm", "cuda_ipc", "pull"
# Why a tensor would go as bytes on the streams when it need not: a pull serves it.
_PULLED_INSTEAD = frozenset(
    {"other node", "other ipc namespace", "shm disabled", "shm full", "gpu not visible to consumer"}
)
# Reasons that are the best a tensor can get; every other reason is a fallback.
_BEST = frozenset({"small", "same gpu", "same ipc namespace"})
# Chunked tensors encoded and not yet sent; more means a caller never sent them.
_MAX_UNSENT = 1024


@dataclass(frozen=True)
class TransportPolicy:
    inline_max_bytes: int = 64 << 10
    shm: bool = True
    cuda_ipc: bool = True
    pull: bool = True
    # Under this a tensor rides its stream: a pull's connection costs more than the bytes.
    pull_min_bytes: int = 1 << 20


def choose(
    tensor: torch.Tensor,
    producer: tensor_pb2.NodeIdentity,
    consumer: tensor_pb2.NodeIdentity | None,
    policy: TransportPolicy,
) -> tuple[str, str]:
    """(transport, reason) for sending ``tensor`` from ``producer`` to ``consumer``."""
    if tensor.numel() * tensor.element_size() < policy.inline_max_bytes:
        return RAW, "small"
    if consumer is None:
        return RAW, "consumer unknown"
    not_gpu = ""
    if tensor.is_cuda:
        not_gpu = _cuda_obstacle(tensor, producer, consumer, policy)
        if not not_gpu:
            return CUDA_IPC, "same gpu"
    if not same_node(producer, consumer):
        return RAW, "other node"
    if not same_ipc(producer, consumer):
        return RAW, "other ipc namespace"
    if not policy.shm:
        return RAW, "shm disabled"
    return SHM, not_gpu or "same ipc namespace"


def _cuda_obstacle(
    tensor: torch.Tensor,
    producer: tensor_pb2.NodeIdentity,
    consumer: tensor_pb2.NodeIdentity,
    policy: TransportPolicy,
) -> str:
    """Why CUDA IPC cannot carry ``tensor``, or "" when it can."""
    if not policy.cuda_ipc:
        return "cuda_ipc disabled"
    index = tensor.device.index or 0
    uuid = producer.gpu_uuids[index] if index < len(producer.gpu_uuids) else ""
    if not same_node(producer, consumer):
        return "other node"
    if not shared_gpu(producer, consumer, uuid):
        return "gpu not visible to consumer"
    if not same_ipc(producer, consumer):
        return "other ipc namespace"
    if not producer.pid_namespace or producer.pid_namespace != consumer.pid_namespace:
        return "other pid namespace"
    return ""


def release_name(msg: tensor_pb2.Tensor) -> str:
    """What a consumer sends back in ReleaseTensors.names for ``msg`` ("" for inline)."""
    kind = msg.WhichOneof("data")
    if kind == SHM:
        return msg.shm.name
    if kind == PULL:
        return key_name(msg.pull.key)
    if kind == CUDA_IPC:
        return ref_name(msg.cuda_ipc)
    return ""


@dataclass
class TransportStats:
    tensors: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    # Tensors sent as the ref of the pooled block they were generated in: no copy.
    in_place: int = 0


class TensorSender:
    """Encodes each tensor for its consumer by the cheapest transport it can open."""

    def __init__(
        self,
        mesh_id: str,
        policy: TransportPolicy,
        *,
        shm: ShmProducer | None,
        cuda: CudaIpcProducer | None,
        chunk_bytes: int | None = None,
        pull: PullServer | None = None,
    ) -> None:
        """``chunk_bytes``: raw tensors larger than this are encoded ``chunked``, their
        bytes left in place until ``take_unsent`` cuts them (None: always inline)."""
        check_mesh_id(mesh_id)
        if shm is not None and shm.mesh_id != mesh_id:
            raise ValueError(f"shm producer is for mesh {shm.mesh_id!r}, not {mesh_id!r}")
        self.mesh_id = mesh_id
        # A missing producer is the same as a transport switched off.
        self.policy = replace(
            policy,
            shm=policy.shm and shm is not None,
            cuda_ipc=policy.cuda_ipc and cuda is not None,
            pull=policy.pull and pull is not None,
        )
        self._shm = shm
        self._cuda = cuda
        self._pull = pull
        self._chunk_bytes = chunk_bytes
        self._unsent: dict[str, chunks.Unsent] = {}
        self._lock = threading.Lock()
        self._stats = TransportStats()

    @property
    def shm(self) -> ShmProducer | None:
        return self._shm

    @property
    def stats(self) -> TransportStats:
        with self._lock:
            s = self._stats
            return TransportStats(dict(s.tensors), dict(s.bytes), dict(s.fallbacks), s.in_place)

    def encode(
        self,
        tensor: torch.Tensor,
        name: str,
        owner: str,
        consumer: tensor_pb2.NodeIdentity | None,
    ) -> tensor_pb2.Tensor:
        """``tensor`` as a message for ``consumer``; shared blocks belong to request ``owner``."""
        kind, reason = choose(tensor, node_identity(), consumer, self.policy)
        msg: tensor_pb2.Tensor | None = None
        if kind == CUDA_IPC and self._cuda is not None:
            msg = self._cuda.share(tensor, owner)
        elif kind == SHM and self._shm is not None:
            msg = self._shm.share(tensor, owner)
            if msg is not None:
                with self._lock:
                    self._stats.in_place += 1
            else:
                try:
                    msg = self._shm.put(tensor, owner)
                except ResourceExhausted:
                    kind, reason = RAW, "shm full"
        nbytes = tensor.numel() * tensor.element_size()
        if msg is None and reason in _PULLED_INSTEAD and self._pull is not None:
            if self.policy.pull and nbytes >= self.policy.pull_min_bytes:
                msg = self._held(tensor, owner)
                kind = PULL if msg is not None else RAW
        if msg is None:
            msg = self._inline(tensor, name)
        msg.name = name
        self._count(kind, reason, nbytes, name, owner)
        return msg

    def _held(self, tensor: torch.Tensor, owner: str) -> tensor_pb2.Tensor | None:
        """``tensor`` held on the data port for its consumer to pull (None: too much held)."""
        assert self._pull is not None
        try:
            ref = self._pull.hold(_bytes_in_place(tensor), owner)
        except ResourceExhausted:
            return None
        ref.producer.CopyFrom(node_identity())
        wire = codec.dtype_name(tensor.dtype)
        return tensor_pb2.Tensor(dtype=wire, shape=list(tensor.shape), pull=ref)

    def _inline(self, tensor: torch.Tensor, name: str) -> tensor_pb2.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if self._chunk_bytes is None or nbytes <= self._chunk_bytes:
            return codec.to_proto(tensor, name)
        # The emitted tensor is the stage's from now on, as with a shared block.
        pending = chunks.unsent(_bytes_in_place(tensor), self._chunk_bytes)
        with self._lock:
            while len(self._unsent) >= _MAX_UNSENT:  # encoded but never sent: a bug
                dropped = self._unsent.pop(next(iter(self._unsent)))
                logger.warning("dropped unsent chunks %s", dropped.chunk_id)
            self._unsent[pending.chunk_id] = pending
        wire = codec.dtype_name(tensor.dtype)
        return tensor_pb2.Tensor(
            name=name, dtype=wire, shape=list(tensor.shape), chunked=pending.ref
        )

    def take_unsent(self, msg: tensor_pb2.Tensor) -> chunks.Unsent | None:
        """The bytes behind a ``chunked`` tensor this sender encoded, to send now."""
        if msg.WhichOneof("data") != "chunked":
            return None
        with self._lock:
            return self._unsent.pop(msg.chunked.chunk_id, None)

    def release(self, owner: str | None = None, names: Iterable[str] = ()) -> int:
        """Free what ``owner`` holds and the blocks named (ReleaseTensors)."""
        names = tuple(names)  # read by both producers
        freed = 0
        if self._shm is not None:
            freed += self._shm.release(owner, names)
        if self._cuda is not None:
            freed += self._cuda.release(owner, names)
        if self._pull is not None:
            freed += self._pull.release(owner, names)
        return freed

    def _count(self, kind: str, reason: str, nbytes: int, name: str, owner: str) -> None:
        with self._lock:
            s = self._stats
            s.tensors[kind] = s.tensors.get(kind, 0) + 1
            s.bytes[kind] = s.bytes.get(kind, 0) + nbytes
            if reason in _BEST:
                return
            first = reason not in s.fallbacks
            s.fallbacks[reason] = s.fallbacks.get(reason, 0) + 1
        if first:
            logger.info(
                "request %s: tensor %s (%s bytes) goes %s: %s (logged once per reason)",
                owner,
                name,
                nbytes,
                kind,
                reason,
            )


def _bytes_in_place(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s bytes, C order, left in its own memory (a copy only if it is not
    contiguous on the CPU); the view keeps that memory alive."""
    flat = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    return flat.reshape(-1).view(torch.uint8).numpy().data


class TensorReceiver:
    """Decodes tensors of any transport; refs only from inside the mesh."""

    def __init__(
        self,
        mesh_id: str,
        *,
        allow_refs: bool,
        root: Path = SHM_ROOT,
        token: str | None = None,
    ) -> None:
        """``token``: the mesh token a pull carries to the producer's data port."""
        self.mesh_id = check_mesh_id(mesh_id)
        self.allow_refs = allow_refs
        self.root = root
        self.token = token

    def decode(
        self,
        msg: tensor_pb2.Tensor,
        field: str,
        chunks: ChunkAssembler | None = None,
        *,
        request_id: str,
    ) -> torch.Tensor:
        """``msg``, an input of request ``request_id``, as a tensor (a shared block
        must have been made for that request); a ``chunked`` one is taken from
        ``chunks``, where its TensorChunk messages were assembled, without another copy."""
        kind = msg.WhichOneof("data")
        if kind in (SHM, CUDA_IPC, PULL) and not self.allow_refs:
            raise InvalidArgument(
                f"{field}: tensor refs are only accepted from inside the mesh", field=field
            )
        if kind == SHM:
            return open_tensor(
                msg, mesh_id=self.mesh_id, request_id=request_id, field=field, root=self.root
            )
        if kind == CUDA_IPC:
            return open_cuda(msg, field=field)
        if kind == PULL:
            # Into memory torch allocates: malloc's warm pages (``keep_freed_memory``),
            # not a fresh mapping that faults in every page as the bytes land.
            flat = torch.empty(checked_size(msg, field), dtype=torch.uint8)
            into = flat.numpy().data
            pull_into(msg.pull, into, field=field, request_id=request_id, token=self.token)
            return flat.view(codec.DTYPES[msg.dtype]).reshape(tuple(msg.shape))
        if kind == "chunked" and chunks is not None:
            return codec.from_buffer(msg, chunks.take(msg.chunked, field), field)
        if kind == "chunked":
            raise InvalidArgument(
                f"{field}: chunked tensor {msg.chunked.chunk_id!r} was not resolved (its "
                "TensorChunk messages must come first on the same stream)",
                field=field,
            )
        return codec.from_proto(msg, field)
