"""Tensor hand-off between two processes, transport by transport.

    python benchmarks/transport.py [--sizes 64K 1M 16M 64M 256M] [--repeats 10] [--out FILE]
                                   [--chunk-sweep 256K 1M 4M ...]

Each sample runs from the producer starting to encode a float32 tensor to the
consumer holding it with every byte read (it sums the tensor), timed on the
system-wide monotonic clock both processes share. Transports:

- shm, as the mesh does it: ``shm pool`` puts the tensor into a warm pooled block
  (one copy); ``shm pool in place`` sends a pooled block the producer generated
  the tensor in (``ShmProducer.allocate``: the generation itself is not timed,
  only share, ref, open and read); ``shm fresh block`` is a new file per tensor
  (no pool, as before the pool).
- ``mesh pull``, the path to a consumer on another node: the stage's encode holds
  the tensor on its data port (a PullRef), the consuming stage's decode pulls it
  over TCP straight into the tensor (``services/mesh/data/pull.py``).
- ``mesh bytes``, the path there before the pull, still taken under
  ``pull_min_bytes`` or with pulls off: a stage's encode and chunk cutting, one
  real gRPC stream, the consuming stage's chunk assembly and decode, at
  ``chunks.CHUNK_BYTES`` (``--chunk-sweep`` adds one row per size).
- raw gRPC (one Tensor message to a grpc.aio server), cuda_ipc (with a GPU only),
  multiprocessing.Queue with a pickled tensor, torch.multiprocessing's own queue
  (tensor storage moved to shared memory), ZeroMQ with a msgpack header and a
  zero-copy frame.
- memcpy in one process, the physical reference: into fresh memory (a new
  anonymous mapping: page faults included, as every hand-off into new memory
  pays them) and into a warm buffer (the bandwidth ceiling).
- "ref" sends an already-created shm ref and opens it without reading: it should
  not grow with size.

Both processes set malloc up as the mesh's processes do (``keep_freed_memory``),
so every transport gets the same allocator. Transports take turns within each
round so drift on a shared machine hits all. Targets at 64 MiB: shm pool in
place >= 0.8x warm memcpy; shm >= 3x mp.Queue; mesh pull >= 1.0x zmq + msgpack
over TCP (two nodes' like-for-like peer).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import median, table, write_json
from benchmarks.transport_ways import Bench, label, parse_size
from services.mesh.data.chunks import CHUNK_BYTES
from services.mesh.data.malloc import keep_freed_memory

DEFAULT_SIZES = ["64K", "1M", "16M", "64M", "256M"]


def at_chunk_size(bench: Bench, chunk_bytes: int) -> Callable[[torch.Tensor], float]:
    def way(src: torch.Tensor) -> float:
        bench.chunk_bytes = chunk_bytes
        try:
            return bench.mesh_bytes(src)
        finally:
            bench.chunk_bytes = CHUNK_BYTES

    return way


def run(sizes: list[int], repeats: int, tmp: Path, sweep: list[int]) -> list[dict[str, Any]]:
    bench = Bench(tmp)
    ways: dict[str, Callable[[torch.Tensor], float]] = {
        "memcpy (fresh dst)": bench.memcpy_fresh,
        "memcpy (warm dst)": bench.memcpy_warm,
        "shm pool in place": bench.shm_in_place,
        "shm pool": bench.shm_pool,
        "shm fresh block": bench.shm_handoff,
        "mesh bytes": bench.mesh_bytes,
        "mesh pull": bench.mesh_pull,
        **{f"mesh bytes @ {label(c)}": at_chunk_size(bench, c) for c in sweep},
        "raw gRPC": bench.raw_grpc,
        "mp.Queue pickle": bench.mp_queue,
        "torch.mp Queue": bench.torch_mp,
        "zmq + msgpack": bench.zeromq,
        "zmq + msgpack (tcp)": bench.zeromq_tcp,
    }
    if bench.cuda is not None:
        ways["cuda_ipc"] = bench.cuda_ipc
    rows: list[dict[str, Any]] = []
    try:
        for nbytes in sizes:
            src = torch.rand(nbytes // 4)
            rounds = max(3, min(repeats, (1 << 30) // nbytes))
            samples: dict[str, list[float]] = {name: [] for name in ways}
            shuffle = random.Random(nbytes)
            for i in range(rounds + 1):
                # A new order each round, so no transport always runs right after
                # the same other one (a big transfer leaves caches and the page
                # allocator in a state the next one pays for).
                names = list(ways)
                shuffle.shuffle(names)
                for name in names:
                    way = ways[name]
                    elapsed = way(src)
                    if i:  # round 0 warms every path up
                        samples[name].append(elapsed)
            # Refs in a row of their own: right after a bulk transfer, a round trip
            # under a millisecond mostly measures the caches that transfer flushed.
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


# Ratios of bandwidth at 64 MiB: (key, transport, baseline), each measured side by side.
RATIOS = [
    ("shm_in_place_64MiB_vs_memcpy_warm", "shm pool in place", "memcpy (warm dst)"),
    ("shm_pool_64MiB_vs_memcpy_warm", "shm pool", "memcpy (warm dst)"),
    ("shm_pool_64MiB_vs_memcpy_fresh", "shm pool", "memcpy (fresh dst)"),
    ("shm_fresh_block_64MiB_vs_memcpy_warm", "shm fresh block", "memcpy (warm dst)"),
    ("shm_pool_64MiB_vs_mp_queue", "shm pool", "mp.Queue pickle"),
    ("mesh_bytes_64MiB_vs_zmq", "mesh bytes", "zmq + msgpack"),
    ("mesh_bytes_64MiB_vs_zmq_tcp", "mesh bytes", "zmq + msgpack (tcp)"),
    ("mesh_bytes_64MiB_vs_mp_queue", "mesh bytes", "mp.Queue pickle"),
    ("mesh_pull_64MiB_vs_zmq_tcp", "mesh pull", "zmq + msgpack (tcp)"),
    ("mesh_pull_64MiB_vs_mesh_bytes", "mesh pull", "mesh bytes"),
]


def targets(rows: list[dict[str, Any]]) -> dict[str, float]:
    def rate(name: str) -> float:
        found = (r["GB/s"] for r in rows if r["transport"] == name and r["size"] == "64 MiB")
        return next(found, float("nan"))

    ref_ms = [r["p50 ms"] for r in rows if r["transport"].startswith("ref")]
    ratios = {key: rate(way) / rate(baseline) for key, way, baseline in RATIOS}
    ratios["ref_max_over_min_latency"] = max(ref_ms) / min(ref_ms)
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="e.g. 64K 1M 256M")
    parser.add_argument("--repeats", type=int, default=10, help="rounds (fewer for big sizes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--chunk-sweep", nargs="*", default=[], help="chunk sizes, e.g. 256K 4M")
    args = parser.parse_args()
    keep_freed_memory()
    sizes = [parse_size(s) for s in args.sizes]
    sweep_sizes = [parse_size(s) for s in args.chunk_sweep]
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(sizes, args.repeats, Path(tmp), sweep_sizes)
    print(table(rows, ["size", "transport", "n", "p50 ms", "min ms", "GB/s"]))
    ratios = targets(rows) if "64M" in [s.upper() for s in args.sizes] else {}
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    print(
        "targets at 64 MiB: shm pool in place >= 0.8x warm memcpy, shm >= 3x mp.Queue, "
        "mesh pull >= 1.0x zmq + msgpack (tcp); ref flat in size"
    )
    path = write_json(
        "transport",
        {
            "rows": rows,
            "ratios": ratios,
            "cpus": os.cpu_count(),
            "repeats": args.repeats,
            "chunk_bytes": CHUNK_BYTES,
        },
        args.out,
    )
    png = path.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
