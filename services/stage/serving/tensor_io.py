"""The stage's side of the data plane: output tensors go to their consumer by
the cheapest transport it can open (CUDA IPC, shared memory, a pull from this
stage's data port, else bytes), input tensors are opened whatever way they
came, and shared blocks and held tensors are freed on ReleaseTensors, after a
TTL, or when the stage stops. Engines that write their
outputs into buffers of ours (``WritesIntoBlocks``) get pooled shared blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator, Sequence

import torch

from services.mesh import environment
from services.mesh.data import chunks
from services.mesh.data.chunk_wire import STAGE_OUTPUT_CHUNK, EncodedChunk
from services.mesh.data.node import mesh_id
from services.mesh.data.pull_server import PullServer
from services.mesh.errors import FailedPrecondition, ResourceExhausted
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.security import SecuritySettings, read_secret
from services.mesh.tensors.cuda_ipc import CudaIpcProducer
from services.mesh.tensors.shm import ShmProducer, sweep
from services.mesh.tensors.transport import TensorReceiver, TensorSender, TransportPolicy
from services.stage.config import Runtime, StageConfig

logger = logging.getLogger(__name__)


class StageTensors:
    def __init__(self, config: StageConfig) -> None:
        runtime = config.runtime
        self.mesh_id = mesh_id()
        self._shm = _shm_producer(self.mesh_id, runtime) if runtime.shm else None
        self._inline_max_bytes = runtime.inline_max_bytes
        self._cuda = CudaIpcProducer() if runtime.device.startswith("cuda") else None
        self._runtime = runtime
        self._security = config.security.with_env()
        token = self._security.mesh_token_file
        self._token = read_secret(token) if token is not None else None
        self._pull: PullServer | None = None
        self.sender = self._sender(None)
        self.receiver = TensorReceiver(self.mesh_id, allow_refs=True, token=self._token)
        self._ttl_s = runtime.shm_ttl_s
        self._expiry: asyncio.Task[None] | None = None

    def _sender(self, pull: PullServer | None) -> TensorSender:
        runtime = self._runtime
        policy = TransportPolicy(
            inline_max_bytes=runtime.inline_max_bytes,
            shm=self._shm is not None,
            cuda_ipc=runtime.device.startswith("cuda"),
            pull=pull is not None,
            pull_min_bytes=runtime.pull_min_bytes,
        )
        return TensorSender(
            self.mesh_id,
            policy,
            shm=self._shm,
            cuda=self._cuda,
            chunk_bytes=runtime.chunk_bytes,
            pull=pull,
        )

    @property
    def shm(self) -> ShmProducer | None:
        return self._shm

    @property
    def pull(self) -> PullServer | None:
        return self._pull

    def start(self, host: str = "127.0.0.1") -> None:
        """Sweep what dead processes left, open the data port on ``host`` (the
        stage's own bind address), and free what nobody releases in time."""
        removed = sweep(self.mesh_id)
        if removed:
            logger.info("removed %d shared block(s) left by dead processes", len(removed))
        self._pull = _pull_server(host, self._runtime, self._security, self._token)
        if self._pull is not None:
            self.sender = self._sender(self._pull)
            logger.info("tensors for consumers on other nodes: pulled from %s", self._pull.address)
        if self._shm is not None or self._pull is not None:
            self._expiry = asyncio.create_task(self._expire_forever(), name="shm-expiry")

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(max(self._ttl_s / 4, 1.0))
            expired = self._shm.expire() if self._shm is not None else 0
            expired += self._pull.expire() if self._pull is not None else 0
            if expired:
                logger.warning("freed %d shared tensor(s) nobody released within the TTL", expired)

    def encode(
        self, tensor: torch.Tensor, name: str, owner: str, consumer: tensor_pb2.NodeIdentity | None
    ) -> tensor_pb2.Tensor:
        return self.sender.encode(tensor, name, owner, consumer)

    def allocate(self, owner: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``OutputBlocks`` for engines: an output buffer in a pooled shared block
        when the tensor would go by shared memory, so ``encode`` sends it without a
        copy (a consumer that cannot open it gets bytes copied out of the block)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._shm is None or nbytes < self._inline_max_bytes:
            return torch.empty(tuple(shape), dtype=dtype)
        try:
            return self._shm.allocate(owner, shape, dtype)
        except ResourceExhausted:
            return torch.empty(tuple(shape), dtype=dtype)  # /dev/shm is full: encode copes

    def chunk_outputs(self, segment: stage_pb2.Segment, threshold: int) -> Iterator[EncodedChunk]:
        """The TensorChunk messages that go before ``segment`` on its stream: the
        bytes of tensors ``encode`` left chunked, then any other raw tensor or blob
        over ``threshold``; each is written from those bytes as it is sent
        (``chunk_wire``: the Generate response serializer encodes it by hand)."""
        for msg in segment.tensors:
            unsent = self.sender.take_unsent(msg)
            if unsent is not None:
                yield from unsent.frames(STAGE_OUTPUT_CHUNK)
        yield from chunks.split_encoded(
            segment.tensors, segment.blobs, STAGE_OUTPUT_CHUNK, threshold=threshold
        )

    def release(self, owner: str | None, names: list[str]) -> int:
        return self.sender.release(owner, names)

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        if self._shm is not None:
            self._shm.close()
        if self._cuda is not None:
            self._cuda.close()
        if self._pull is not None:
            self._pull.close()


def _pull_server(
    host: str, runtime: Runtime, security: SecuritySettings, token: str | None
) -> PullServer | None:
    """The stage's data port, or None where tensors must stay on the streams: pulls
    switched off, or a mesh with TLS (the data port speaks plain TCP; the streams
    keep their TLS)."""
    if not runtime.pull:
        return None
    if security.tls:
        logger.info("a TLS mesh: tensors for other nodes go on the (TLS) streams, not pulled")
        return None
    host = host.strip("[]")
    advertise = environment.ADVERTISE_HOST.get()
    if not advertise and host in ("0.0.0.0", "::", ""):
        advertise = socket.gethostbyname(socket.gethostname())
    try:
        return PullServer(
            bind=host,
            advertise=advertise,
            port=runtime.data_port,
            token=token,
            ttl_s=runtime.shm_ttl_s,
        )
    except OSError as exc:
        raise OSError(
            f"cannot open the data port (runtime.data_port {runtime.data_port}) on {host}: "
            f"{exc.strerror or exc}"
        ) from None


def _shm_producer(mesh: str, runtime: Runtime) -> ShmProducer | None:
    """The stage's shared blocks; None (tensors go as bytes) when the mesh's
    directory is not private to this user: it is never written to then."""
    try:
        return ShmProducer(mesh, ttl_s=runtime.shm_ttl_s, pool_bytes=runtime.shm_pool_bytes)
    except FailedPrecondition as exc:
        logger.error("shared memory off, tensors go as bytes: %s", exc.message)
        return None
