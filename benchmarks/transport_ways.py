"""The two ends of every transport benchmarks/transport.py compares: the consumer
process (it serves each transport and answers each hand-off with the time it
finished) and the producer's ``Bench``, one method per timed hand-off."""

from __future__ import annotations

import asyncio
import mmap
import multiprocessing as mp
import pickle
import struct
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import msgpack
import torch
import zmq

from services.mesh.data import chunks
from services.mesh.data.chunk_wire import STAGE_INPUT_CHUNK, ChunkFrame, EncodedChunk, serializer
from services.mesh.data.chunks import CHUNK_BYTES, ChunkAssembler
from services.mesh.data.malloc import keep_freed_memory
from services.mesh.data.node import node_identity
from services.mesh.data.pull_server import PullServer
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.tensors import codec
from services.mesh.tensors.shm import ShmProducer, open_tensor, sweep
from services.mesh.tensors.transport import TensorReceiver, TensorSender, TransportPolicy
from services.stage.serving.frames import InputFrame, read_input
from services.stage.serving.inputs import decode

MESH_OF_BYTES = "benchbytes"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_SIZES = ["64K", "1M", "16M", "64M", "256M"]
SINK = "/bench.Sink/Put"
CHUNKED_SINK = "/bench.Sink/PutChunked"
OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].isalpha() else int(text)


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def touch(tensor: torch.Tensor) -> float:
    return float(tensor.sum())


# --- consumer process --------------------------------------------------------------


def consumer(conn: Connection, queue: Any, tmq: Any, zmq_addr: str, mesh: str) -> None:
    """Serves every transport; answers each hand-off with the time it finished."""
    keep_freed_memory()
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    loop_ready = threading.Event()
    port: list[int] = []
    threading.Thread(target=serve_grpc, args=(port, loop_ready), daemon=True).start()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    sock.bind(zmq_addr)
    tcp: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    tcp_port = tcp.bind_to_random_port("tcp://127.0.0.1")
    loop_ready.wait()
    conn.send((port[0], tcp_port))
    while (command := conn.recv()) is not None:
        kind, payload = command
        if kind in ("shm", "ref"):
            msg = tensor_pb2.Tensor.FromString(payload)
            owner = "refs" if kind == "ref" else "bench"  # the producer's requests
            tensor = open_tensor(msg, mesh_id=mesh, request_id=owner, field="t")
            if kind == "shm":
                touch(tensor)
        elif kind == "pull":
            # What a stage does with a Submit whose tensor came as a PullRef.
            submit = stage_pb2.Submit.FromString(payload)
            receiver = TensorReceiver(MESH_OF_BYTES, allow_refs=True)
            tensor = decode(submit.inputs, receiver, request_id="bench").tensors["t"]
            touch(tensor)
        elif kind == "cuda_ipc":
            from services.mesh.tensors.cuda_ipc import open_cuda

            tensor = open_cuda(tensor_pb2.Tensor.FromString(payload), field="t")
            touch(tensor)
            torch.cuda.synchronize()
        elif kind == "queue":
            tensor = pickle.loads(queue.get())
            touch(tensor)
        elif kind == "torch.mp":
            tensor = tmq.get()
            touch(tensor)
        elif kind in ("zmq", "zmq_tcp"):
            on = sock if kind == "zmq" else tcp
            header, frame = on.recv_multipart(copy=False)
            meta = msgpack.unpackb(header.bytes)
            flat = torch.frombuffer(frame.buffer, dtype=torch.uint8)  # zero copy, read-only
            tensor = flat.view(codec.DTYPES[meta["dtype"]]).reshape(meta["shape"])
            touch(tensor)
        conn.send(time.perf_counter())
        del tensor  # unmapping/freeing is the consumer's own time, not the hand-off's


def serve_grpc(port: list[int], ready: threading.Event) -> None:
    async def put(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        touch(codec.from_proto(tensor_pb2.Tensor.FromString(request), "t"))
        return struct.pack("d", time.perf_counter())

    async def put_chunked(
        messages: AsyncIterator[InputFrame],
        context: grpc.aio.ServicerContext,
    ) -> bytes:
        # What a stage does with a Submit whose tensors came as chunks on its stream.
        assembler = ChunkAssembler(1 << 40)
        receiver = TensorReceiver(MESH_OF_BYTES, allow_refs=False)
        async for message in messages:
            if isinstance(message, ChunkFrame) or message.HasField("chunk"):
                assembler.add(message.chunk)
                continue
            inputs = decode(message.submit.inputs, receiver, assembler, request_id="bench")
            touch(inputs.tensors["t"])
        return struct.pack("d", time.perf_counter())

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        handlers = {
            "Put": grpc.unary_unary_rpc_method_handler(put),
            "PutChunked": grpc.stream_unary_rpc_method_handler(
                put_chunked, request_deserializer=read_input
            ),
        }
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("bench.Sink", handlers)]
        )
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


# --- producer side -----------------------------------------------------------------


class Bench:
    """The producer's end of every transport; each call is one timed hand-off."""

    def __init__(self, tmp: Path) -> None:
        self.mesh = f"bench{uuid.uuid4().hex[:8]}"
        ctx = mp.get_context("spawn")
        self.queue: Any = ctx.Queue()
        self.tmq: Any = ctx.Queue()  # same class; torch's reductions pickle tensors into shm
        addr = f"ipc://{tmp}/zmq.sock"
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=consumer, args=(child, self.queue, self.tmq, addr, self.mesh), daemon=True
        )
        self.proc.start()
        grpc_port, tcp_port = self.conn.recv()
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.connect(addr)
        self.tcp: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
        self.tcp.connect(f"tcp://127.0.0.1:{tcp_port}")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=OPTIONS)
        self.put = self.channel.unary_unary(SINK)
        self.put_chunked = self.channel.stream_unary(
            CHUNKED_SINK, request_serializer=serializer(stage_pb2.StageInput.SerializeToString)
        )
        self.chunk_bytes = CHUNK_BYTES
        self.shm = ShmProducer(self.mesh, pool_bytes=0)
        self.pool = ShmProducer(self.mesh)
        self.cuda: Any = None
        if torch.cuda.is_available():
            from services.mesh.tensors.cuda_ipc import CudaIpcProducer

            self.cuda = CudaIpcProducer()
        self.refs: dict[int, bytes] = {}
        self.warm: dict[int, torch.Tensor] = {}
        self.pull = PullServer()
        self.puller = TensorSender(
            MESH_OF_BYTES, TransportPolicy(), shm=None, cuda=None, pull=self.pull
        )
        # A consumer on another node, as the stage reads it from the orchestrator.
        self.elsewhere = tensor_pb2.NodeIdentity()
        self.elsewhere.CopyFrom(node_identity())
        self.elsewhere.k8s_node_name, self.elsewhere.boot_id = "node-b", "another-boot"

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
        self.shm.close()
        self.pool.close()
        self.pull.close()
        sweep(self.mesh)
        self.channel.close()
        self.sock.close(linger=0)
        self.tcp.close(linger=0)

    def _ask(self, kind: str, payload: bytes = b"") -> float:
        self.conn.send((kind, payload))
        finished: float = self.conn.recv()
        return finished

    def memcpy_fresh(self, src: torch.Tensor) -> float:
        nbytes = src.numel() * src.element_size()
        start = time.perf_counter()
        fresh = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        torch.frombuffer(fresh, dtype=src.dtype).copy_(src)
        elapsed = time.perf_counter() - start
        fresh.close()
        return elapsed

    def memcpy_warm(self, src: torch.Tensor) -> float:
        if src.numel() not in self.warm:
            self.warm[src.numel()] = torch.empty_like(src)
        target = self.warm[src.numel()]
        start = time.perf_counter()
        target.copy_(src)
        return time.perf_counter() - start

    def raw_grpc(self, src: torch.Tensor) -> float:
        start = time.perf_counter()
        reply = self.put(codec.to_proto(src, "t").SerializeToString())
        return float(struct.unpack("d", reply)[0]) - start

    def mesh_bytes(self, src: torch.Tensor) -> float:
        """The mesh's bytes path for a consumer on another node: a stage's encode and
        chunk cutting (``StageTensors.chunk_outputs``) with the mesh's serializer
        (chunks encoded by hand, ``chunk_wire``), one real gRPC stream, and the
        consuming stage's deserializer (``read_input``), assembly and decode."""
        start = time.perf_counter()
        sender = TensorSender(
            MESH_OF_BYTES, TransportPolicy(), shm=None, cuda=None, chunk_bytes=self.chunk_bytes
        )
        submit = stage_pb2.Submit(request_id="bench", is_last=True)
        submit.inputs.tensors.append(sender.encode(src, "t", "bench", None))

        def messages() -> Iterator[stage_pb2.StageInput | EncodedChunk]:
            for msg in submit.inputs.tensors:
                unsent = sender.take_unsent(msg)
                if unsent is not None:
                    yield from unsent.frames(STAGE_INPUT_CHUNK)
            yield from chunks.split_encoded(
                submit.inputs.tensors, [], STAGE_INPUT_CHUNK, threshold=self.chunk_bytes
            )
            yield stage_pb2.StageInput(submit=submit)

        reply = self.put_chunked(messages())
        return float(struct.unpack("d", reply)[0]) - start

    def mesh_pull(self, src: torch.Tensor) -> float:
        """The mesh's path to a consumer on another node since the pull: the stage's
        encode holds the tensor on its data port (``PullRef``), the ref goes over,
        and the consuming stage's decode pulls the bytes over TCP into its tensor."""
        start = time.perf_counter()
        submit = stage_pb2.Submit(request_id="bench", is_last=True)
        submit.inputs.tensors.append(self.puller.encode(src, "t", "bench", self.elsewhere))
        assert submit.inputs.tensors[0].WhichOneof("data") == "pull"
        finished = self._ask("pull", submit.SerializeToString())
        self.puller.release("bench")
        return finished - start

    def shm_handoff(self, src: torch.Tensor) -> float:
        start = time.perf_counter()
        msg = self.shm.put(src, "bench")
        finished = self._ask("shm", msg.SerializeToString())
        self.shm.release("bench")
        return finished - start

    def shm_pool(self, src: torch.Tensor) -> float:
        start = time.perf_counter()
        msg = self.pool.put(src, "bench")
        finished = self._ask("shm", msg.SerializeToString())
        self.pool.release("bench")
        return finished - start

    def shm_in_place(self, src: torch.Tensor) -> float:
        out = self.pool.allocate("bench", src.shape, src.dtype)
        out.copy_(src)  # the engine generating its output: not part of the hand-off
        start = time.perf_counter()
        msg = self.pool.share(out, "bench")
        assert msg is not None
        finished = self._ask("shm", msg.SerializeToString())
        self.pool.release("bench")
        return finished - start

    def ref(self, src: torch.Tensor) -> float:
        if src.numel() not in self.refs:
            self.refs[src.numel()] = self.shm.put(src, "refs").SerializeToString()
        start = time.perf_counter()
        return self._ask("ref", self.refs[src.numel()]) - start

    def cuda_ipc(self, src: torch.Tensor) -> float:
        on_gpu = src.cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        msg = self.cuda.share(on_gpu, "bench")
        finished = self._ask("cuda_ipc", msg.SerializeToString())
        self.cuda.release("bench")
        return finished - start

    def mp_queue(self, src: torch.Tensor) -> float:
        self.conn.send(("queue", b""))
        start = time.perf_counter()
        self.queue.put(pickle.dumps(src, protocol=pickle.HIGHEST_PROTOCOL))
        return self.conn.recv() - start

    def torch_mp(self, src: torch.Tensor) -> float:
        fresh = src.clone()  # once sent, a storage stays in shm: later sends would be free
        self.conn.send(("torch.mp", b""))
        start = time.perf_counter()
        self.tmq.put(fresh)
        return self.conn.recv() - start

    def zeromq(self, src: torch.Tensor) -> float:
        """ZeroMQ over a Unix socket: what two processes on one node would use."""
        return self._zeromq(src, "zmq", self.sock)

    def zeromq_tcp(self, src: torch.Tensor) -> float:
        """ZeroMQ over TCP (loopback here): what stages on two nodes would use, the
        like-for-like peer of the mesh's bytes path."""
        return self._zeromq(src, "zmq_tcp", self.tcp)

    def _zeromq(self, src: torch.Tensor, kind: str, sock: zmq.Socket[bytes]) -> float:
        self.conn.send((kind, b""))
        start = time.perf_counter()
        header = msgpack.packb({"dtype": "float32", "shape": list(src.shape)})
        frame = src.view(torch.uint8).numpy().data
        sock.send_multipart([header, frame], copy=False)
        return self.conn.recv() - start
