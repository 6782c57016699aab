"""Tensor hand-off between two processes, transport by transport.

    python benchmarks/transport.py [--sizes 64K 1M 16M 64M 256M] [--repeats 10] [--out FILE]

Each sample runs from the producer starting to encode a float32 tensor to the
consumer holding it with every byte read (it sums the tensor), timed on the
system-wide monotonic clock both processes share. Transports: raw gRPC (one
Tensor message to a grpc.aio server), shm (ShmProducer.put + open_tensor),
cuda_ipc (with a GPU only), multiprocessing.Queue with a pickled tensor,
torch.multiprocessing's own queue (tensor storage moved to shared memory),
ZeroMQ with a msgpack header and a zero-copy frame, and memcpy in one process as
the physical reference: into a fresh buffer (page faults included, as every
hand-off into new memory pays them) and into a warm one (the bandwidth ceiling).
"ref" sends an already-created shm ref and opens it without reading: it should
not grow with size.

Transports take turns within each round so drift on a shared machine hits all.
Targets: shm hand-off of 64 MiB >= 0.8x memcpy bandwidth and >= 3x mp.Queue.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import pickle
import struct
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import msgpack
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import median, table, write_json
from services.mesh import tensors
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.shm import ShmProducer, open_tensor, sweep

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_SIZES = ["64K", "1M", "16M", "64M", "256M"]
SINK = "/bench.Sink/Put"
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
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    loop_ready = threading.Event()
    port: list[int] = []
    threading.Thread(target=serve_grpc, args=(port, loop_ready), daemon=True).start()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    sock.bind(zmq_addr)
    loop_ready.wait()
    conn.send(port[0])
    while (command := conn.recv()) is not None:
        kind, payload = command
        if kind in ("shm", "ref"):
            tensor = open_tensor(tensor_pb2.Tensor.FromString(payload), mesh_id=mesh, field="t")
            if kind == "shm":
                touch(tensor)
        elif kind == "cuda_ipc":
            from services.mesh.cuda_ipc import open_cuda

            tensor = open_cuda(tensor_pb2.Tensor.FromString(payload), field="t")
            touch(tensor)
            torch.cuda.synchronize()
        elif kind == "queue":
            tensor = pickle.loads(queue.get())
            touch(tensor)
        elif kind == "torch.mp":
            tensor = tmq.get()
            touch(tensor)
        elif kind == "zmq":
            header, frame = sock.recv_multipart(copy=False)
            meta = msgpack.unpackb(header.bytes)
            flat = torch.frombuffer(frame.buffer, dtype=torch.uint8)  # zero copy, read-only
            tensor = flat.view(tensors.DTYPES[meta["dtype"]]).reshape(meta["shape"])
            touch(tensor)
        conn.send(time.perf_counter())
        del tensor  # unmapping/freeing is the consumer's own time, not the hand-off's


def serve_grpc(port: list[int], ready: threading.Event) -> None:
    async def put(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        touch(tensors.from_proto(tensor_pb2.Tensor.FromString(request), "t"))
        return struct.pack("d", time.perf_counter())

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        handler = grpc.unary_unary_rpc_method_handler(put)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("bench.Sink", {"Put": handler})]
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
        grpc_port = self.conn.recv()
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.connect(addr)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=OPTIONS)
        self.put = self.channel.unary_unary(SINK)
        self.shm = ShmProducer(self.mesh)
        self.cuda: Any = None
        if torch.cuda.is_available():
            from services.mesh.cuda_ipc import CudaIpcProducer

            self.cuda = CudaIpcProducer()
        self.refs: dict[int, bytes] = {}
        self.warm: dict[int, torch.Tensor] = {}

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
        self.shm.close()
        sweep(self.mesh)
        self.channel.close()
        self.sock.close(linger=0)

    def _ask(self, kind: str, payload: bytes = b"") -> float:
        self.conn.send((kind, payload))
        finished: float = self.conn.recv()
        return finished

    def memcpy_fresh(self, src: torch.Tensor) -> float:
        start = time.perf_counter()
        torch.empty_like(src).copy_(src)
        return time.perf_counter() - start

    def memcpy_warm(self, src: torch.Tensor) -> float:
        if src.numel() not in self.warm:
            self.warm[src.numel()] = torch.empty_like(src)
        target = self.warm[src.numel()]
        start = time.perf_counter()
        target.copy_(src)
        return time.perf_counter() - start

    def raw_grpc(self, src: torch.Tensor) -> float:
        start = time.perf_counter()
        reply = self.put(tensors.to_proto(src, "t").SerializeToString())
        return float(struct.unpack("d", reply)[0]) - start

    def shm_handoff(self, src: torch.Tensor) -> float:
        start = time.perf_counter()
        msg = self.shm.put(src, "bench")
        finished = self._ask("shm", msg.SerializeToString())
        self.shm.release("bench")
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
        self.conn.send(("zmq", b""))
        start = time.perf_counter()
        header = msgpack.packb({"dtype": "float32", "shape": list(src.shape)})
        frame = src.view(torch.uint8).numpy().data
        self.sock.send_multipart([header, frame], copy=False)
        return self.conn.recv() - start


def run(sizes: list[int], repeats: int, tmp: Path) -> list[dict[str, Any]]:
    bench = Bench(tmp)
    ways: dict[str, Callable[[torch.Tensor], float]] = {
        "memcpy (fresh dst)": bench.memcpy_fresh,
        "memcpy (warm dst)": bench.memcpy_warm,
        "shm": bench.shm_handoff,
        "raw gRPC": bench.raw_grpc,
        "mp.Queue pickle": bench.mp_queue,
        "torch.mp Queue": bench.torch_mp,
        "zmq + msgpack": bench.zeromq,
    }
    if bench.cuda is not None:
        ways["cuda_ipc"] = bench.cuda_ipc
    rows: list[dict[str, Any]] = []
    try:
        for nbytes in sizes:
            src = torch.rand(nbytes // 4)
            rounds = max(3, min(repeats, (256 << 20) // nbytes))
            samples: dict[str, list[float]] = {name: [] for name in ways}
            for i in range(rounds + 1):
                for name, way in ways.items():
                    elapsed = way(src)
                    if i:  # round 0 warms every path up
                        samples[name].append(elapsed)
            # Refs in a row of their own: right after a bulk transfer, a 0.3 ms
            # round trip mostly measures the caches that transfer flushed.
            samples["ref (shm, no data)"] = [bench.ref(src) for _ in range(11)][1:]
            for name, values in samples.items():
                seconds = median(values)
                rows.append(
                    {
                        "size": label(nbytes),
                        "bytes": nbytes,
                        "transport": name,
                        "n": len(values),
                        "p50 ms": seconds * 1e3,
                        "min ms": min(values) * 1e3,
                        "GB/s": nbytes / seconds / 1e9,
                    }
                )
            print(f"  {label(nbytes)} done", file=sys.stderr, flush=True)
    finally:
        bench.close()
    if bench.cuda is None:
        skipped = {"transport": "cuda_ipc", "n": "skipped (no CUDA GPU)"}
        rows += [{"size": label(n), "bytes": n, **skipped} for n in sizes]
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, ref) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["transport"] for r in rows if "GB/s" in r):
        mine = [r for r in rows if r["transport"] == name and "GB/s" in r]
        axis, key = (ref, "p50 ms") if name.startswith("ref") else (rate, "GB/s")
        axis.plot([r["bytes"] for r in mine], [r[key] for r in mine], marker="o", label=name)
    rate.set(yscale="log", ylabel="GB/s", title="hand-off bandwidth")
    ref.set(ylabel="ms (p50)", title="ref passing (linear scale from 0)")
    ref.set_ylim(bottom=0)
    for axis in (rate, ref):
        axis.set(xscale="log", xlabel="tensor bytes")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def targets(rows: list[dict[str, Any]]) -> dict[str, float]:
    def rate(name: str, size: str) -> float:
        return next((r["GB/s"] for r in rows if r["transport"] == name and r["size"] == size), 0.0)

    ref_ms = [r["p50 ms"] for r in rows if r["transport"].startswith("ref")]
    return {
        "shm_64MiB_vs_memcpy_fresh": rate("shm", "64 MiB") / rate("memcpy (fresh dst)", "64 MiB"),
        "shm_64MiB_vs_memcpy_warm": rate("shm", "64 MiB") / rate("memcpy (warm dst)", "64 MiB"),
        "shm_64MiB_vs_mp_queue": rate("shm", "64 MiB") / rate("mp.Queue pickle", "64 MiB"),
        "ref_max_over_min_latency": max(ref_ms) / min(ref_ms),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="e.g. 64K 1M 256M")
    parser.add_argument("--repeats", type=int, default=10, help="rounds (fewer for big sizes)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(sizes, args.repeats, Path(tmp))
    print(table(rows, ["size", "transport", "n", "p50 ms", "min ms", "GB/s"]))
    ratios = targets(rows) if "64M" in [s.upper() for s in args.sizes] else {}
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    print("targets: shm 64 MiB >= 0.8x memcpy and >= 3x mp.Queue; ref flat in size")
    path = write_json(
        "transport",
        {"rows": rows, "ratios": ratios, "cpus": os.cpu_count(), "repeats": args.repeats},
        args.out,
    )
    png = path.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
