"""Scale out: every replica of a stage serves, and requests go where there is room.

    python benchmarks/scale_out.py [--mode spread|first-request|rolling]
        [--replicas 8] [--requests 256] [--mix-replicas 4] [--mix-interval S]
        [--rolling-replicas 3]
        [--runs 3] [--out FILE]

Real stage processes (a tiny random-weight Llama on SmolLM2's tokenizer, one
request at a time each: ``max_batch_size: 1``) on 127.0.0.1, 127.0.0.2, … behind
one ``ipv4:`` address, and an in-process orchestrator. ``--mode spread`` (the
default), parts 1 and 2:

1. ``--replicas`` replicas, ``--requests`` short requests 32 at a time: requests
   each replica served (the orchestrator's count, ListStages) per run. Targets:
   all serve, the busiest <= 1.25x the least busy.
2. The first ``--mix-replicas`` of them, a mix: 3 long answers (128 tokens) among
   64 short ones (2 tokens), once with least-outstanding routing and once round
   robin, side by side in each run: p99 of the short ones' latency. Target:
   least-outstanding <= 0.6x round robin. A request arrives every
   ``--mix-interval`` s; by default 1.5x a short answer's latency measured alone
   in that run, so that one replica free of long answers can carry every short
   one: routing by room needs room (at 20 ms on two cores the one free replica
   is overloaded, and every policy queues short answers somewhere).

Replicas coming and going under a steady load (4 clients, each sending its next
request as its last one ends; ``_replica_turnover``), each replica on its own
loopback address, all on one port:

3. ``--mode first-request``: 2 replicas serve; a third starts. Seconds from its
   READY (its InitStatus) to its first request (the orchestrator's count), on an
   ``ipv4:`` address that lists it from the start, and on a ``dns:`` name whose
   answer lists it once it is ready (looked up again every second). Target: <= 2 s.
4. ``--mode rolling``: ``--rolling-replicas`` replicas, each replaced in turn as a
   rolling update does (the new one READY, then the old one SIGTERM: it drains),
   one answer in 8 long (32 tokens). Requests failed (target: 0) and served.

Figures on a shared machine are noisy: ranges over ``--runs``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks import _replica_turnover as turnover
from benchmarks._common import table, write_json
from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.pb.omni.v1.orchestrator_pb2 import REPLICA_READY
from services.testing.configs import SMOLLM2, TINY_LLAMA

LONG, SHORT = 128, 2  # tokens of a long and a short answer
CONCURRENCY = 32


def stage_file(folder: Path, cache: str) -> Path:
    config = {
        "name": "solo",
        "engine": "transformers",
        "model": SMOLLM2,
        "cache_dir": cache,
        "load_format": "dummy",
        "engine_args": {"config_overrides": TINY_LLAMA},
        "defaults": {"temperature": 0.0},
        "runtime": {"torch_threads": 1, "max_batch_size": 1, "max_queue_size": 256},
    }
    path = folder / "solo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def start_replicas(processes: list[StageProcess]) -> list[str]:
    addresses = []
    for process in processes:  # one by one: eight importing torch at once crawl on two cores
        addresses.append(await process.start(timeout_s=300))
    return addresses


def pipeline(addresses: list[str], routing: str) -> Any:
    stage = {"name": "solo", "address": "ipv4:" + ",".join(addresses), "routing": routing}
    return parse_pipeline({"name": "scale", "stages": [stage], "outputs": ["solo"]}, "scale.yaml")


async def served(client: AsyncClient) -> dict[str, int]:
    (stage,) = await client.list_stages()
    return {r.address: r.served for r in stage.replicas}


async def orchestrated(addresses: list[str], routing: str) -> tuple[OrchestratorServer, int]:
    server = OrchestratorServer(pipeline(addresses, routing))
    port = await server.start("127.0.0.1", 0)
    return server, port


async def spread(addresses: list[str], requests: int) -> dict[str, Any]:
    """Part 1: requests per replica over one wave of ``requests``."""
    server, port = await orchestrated(addresses, "least_outstanding")
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=600)
            await until_all_ready(client, len(addresses))
            before = await served(client)
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(index: int) -> bool:
                async with gate:
                    result = await client.generate(
                        f"Say {index}.", params={"max_tokens": 4}
                    ).collect()
                    return result.ok

            oks = await asyncio.gather(*(one(i) for i in range(requests)))
            after = await served(client)
    finally:
        await server.stop(1.0)
    counts = {a: after[a] - before.get(a, 0) for a in after}
    low, high = min(counts.values()), max(counts.values())
    return {
        "failed": oks.count(False),
        "per_replica": counts,
        "serving": sum(1 for c in counts.values() if c),
        "busiest_over_least": high / low if low else float("inf"),
    }


async def until_all_ready(client: AsyncClient, count: int) -> None:
    for _ in range(200):
        (stage,) = await client.list_stages()
        if sum(1 for r in stage.replicas if r.state == REPLICA_READY) == count:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"not all {count} replicas READY")


async def short_alone(addresses: list[str]) -> float:
    """A short answer's median latency, one request at a time."""
    server, port = await orchestrated(addresses, "least_outstanding")
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=600)
            await until_all_ready(client, len(addresses))
            took = []
            for _ in range(16):
                began = time.perf_counter()
                result = await client.generate("Tell me.", params={"max_tokens": SHORT}).collect()
                assert result.ok, result.done
                took.append(time.perf_counter() - began)
    finally:
        await server.stop(1.0)
    return sorted(took)[len(took) // 2]


async def mix(addresses: list[str], routing: str, interval_s: float) -> dict[str, Any]:
    """Part 2: latency of short answers among long ones, one arriving every ``interval_s``."""
    server, port = await orchestrated(addresses, routing)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=600)
            await until_all_ready(client, len(addresses))

            async def one(tokens: int) -> float:
                began = time.perf_counter()
                result = await client.generate("Tell me.", params={"max_tokens": tokens}).collect()
                assert result.ok, result.done
                return time.perf_counter() - began

            # 3 long among 64 short: fewer long answers at once than replicas, so
            # there is always a replica with room; dealt in turn, shorts queue behind them.
            kinds = [LONG if i % 24 == 0 else SHORT for i in range(67)]
            tasks = []
            for tokens in kinds:
                tasks.append(asyncio.create_task(one(tokens)))
                await asyncio.sleep(interval_s)
            took = await asyncio.gather(*tasks)
    finally:
        await server.stop(1.0)
    short = sorted(t for t, k in zip(took, kinds, strict=True) if k == SHORT)
    return {"short_p50_s": short[len(short) // 2], "short_p99_s": short[-1 - len(short) // 100]}


def span(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        config = stage_file(Path(folder), args.cache_dir)
        if args.mode == "spread":
            runs = await spread_runs(config, args)
            rows, name = spread_rows(runs, args), "scale_out"
        else:
            slots = turnover.Slots(config, turnover.free_port())
            try:
                if args.mode == "first-request":
                    runs = await first_request_runs(slots, args)
                    rows, name = first_request_rows(runs), "scale_out_first_request"
                else:
                    runs = await rolling_runs(slots, args)
                    rows, name = rolling_rows(runs, args), "scale_out_rolling"
            finally:
                await slots.close()
    print(table(rows, ["measure", "runs", "target"]))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path = write_json(name, {"args": settings, "runs": runs}, args.out)
    print(f"\nwritten to {path}")


async def spread_runs(config: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    processes = [StageProcess(config, host=f"127.0.0.{i + 1}") for i in range(args.replicas)]
    try:
        addresses = await start_replicas(processes)
        runs: list[dict[str, Any]] = []
        for _ in range(args.runs):
            run: dict[str, Any] = {"spread": await spread(addresses, args.requests)}
            subset = addresses[: args.mix_replicas]
            alone = run["short_alone_s"] = await short_alone(subset)
            interval = run["interval_s"] = args.mix_interval or 1.5 * alone
            run["least_outstanding"] = await mix(subset, "least_outstanding", interval)
            run["round_robin"] = await mix(subset, "round_robin", interval)
            lo, rr = run["least_outstanding"], run["round_robin"]
            run["p99_ratio"] = lo["short_p99_s"] / rr["short_p99_s"]
            runs.append(run)
    finally:
        await asyncio.gather(*(p.stop(2.0) for p in processes))
    return runs


def spread_rows(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        {
            "measure": f"{args.replicas} replicas: replicas serving",
            "runs": ", ".join(str(r["spread"]["serving"]) for r in runs),
            "target": f"all {args.replicas}",
        },
        {
            "measure": "busiest / least busy (requests)",
            "runs": span([r["spread"]["busiest_over_least"] for r in runs]),
            "target": "<= 1.25",
        },
        {
            "measure": f"{args.mix_replicas} replicas, mix: a request every (ms)",
            "runs": span([r["interval_s"] * 1e3 for r in runs]),
            "target": "",
        },
        {
            "measure": f"{args.mix_replicas} replicas, mix: short p99 least-outstanding (s)",
            "runs": span([r["least_outstanding"]["short_p99_s"] for r in runs]),
            "target": "",
        },
        {
            "measure": "short p99 round robin (s)",
            "runs": span([r["round_robin"]["short_p99_s"] for r in runs]),
            "target": "",
        },
        {
            "measure": "p99 least-outstanding / round robin",
            "runs": span([r["p99_ratio"] for r in runs]),
            "target": "<= 0.6",
        },
    ]


async def first_request_runs(
    slots: turnover.Slots, args: argparse.Namespace
) -> list[dict[str, Any]]:
    for slot in (1, 2):  # one by one: torch imported twice at once crawls on two cores
        await slots.start(slot)
    runs = []
    for _ in range(args.runs):
        runs.append({t: await turnover.first_request(slots, t) for t in ("ipv4", "dns")})
    return runs


def first_request_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for target, how in (("ipv4", "listed before it starts"), ("dns", "looked up every second")):
        rows.append(
            {
                "measure": f"{target} ({how}): READY -> first request (s)",
                "runs": ", ".join(f"{r[target]['ready_to_first_request_s']:.2f}" for r in runs),
                "target": "<= 2",
            }
        )
    rows.append(
        {
            "measure": "requests failed meanwhile",
            "runs": ", ".join(str(r["ipv4"]["failed"] + r["dns"]["failed"]) for r in runs),
            "target": "0",
        }
    )
    return rows


async def rolling_runs(slots: turnover.Slots, args: argparse.Namespace) -> list[dict[str, Any]]:
    count = args.rolling_replicas
    old, new = list(range(1, count + 1)), list(range(count + 1, 2 * count + 1))
    for slot in old:
        await slots.start(slot)
    runs = []
    for _ in range(args.runs):  # each run replaces the last one's replicas
        runs.append(await turnover.rolling(slots, old, new))
        old, new = new, old
    return runs


def rolling_rows(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    count = args.rolling_replicas
    return [
        {
            "measure": f"rolling replacement of {count}: requests failed",
            "runs": ", ".join(str(r["failed"]) for r in runs),
            "target": "0",
        },
        {
            "measure": "requests served",
            "runs": ", ".join(str(r["served"]) for r in runs),
            "target": "",
        },
        {
            "measure": "replacement took (s)",
            "runs": span([r["seconds"] for r in runs]),
            "target": "",
        },
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--mix-replicas", type=int, default=4)
    parser.add_argument(
        "--mix-interval", type=float, default=0.0, help="s between the mix's requests (0: auto)"
    )
    parser.add_argument("--mode", choices=["spread", "first-request", "rolling"], default="spread")
    parser.add_argument("--rolling-replicas", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache-dir", default=".cache")
    parser.add_argument("--out", type=Path)
    arguments = parser.parse_args()
    arguments.cache_dir = str(Path(arguments.cache_dir).resolve())
    asyncio.run(main(arguments))
