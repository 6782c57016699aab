"""What one orchestrator carries, and what two carry together (issue 39).

    python benchmarks/orchestrators.py [--stages 2] [--requests 256] [--concurrency 32]
        [--tokens 16] [--runs 3] [--out FILE]

Real processes on 127.0.0.1: ``--stages`` replicas of a tiny stage (a random-weight
Llama on SmolLM2's tokenizer: its compute is small, so the orchestrators' work
shows) behind one ``ipv4:`` address, each answer ``--tokens`` tokens sent one a
segment (so every token is an output the orchestrator relays), and one, then two
orchestrator processes (``omni orchestrator serve --peers``) over them. One Python
client given every orchestrator (round_robin) sends ``--requests`` requests,
``--concurrency`` at a time.

Reported per count of orchestrators, as ranges over ``--runs``: requests/s and
relayed outputs/s of the wave (wall clock), the orchestrators' CPU seconds (user +
system, from /proc, summed over the orchestrator processes) and requests and
outputs per orchestrator CPU-second; then two over one for the wave's requests/s.
On a machine with few cores the stages, the client and the orchestrators share
them: two orchestrators carry more only where there are cores for them, and the
per-CPU-second figures are what says how much an orchestrator costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import table, write_json
from orchestrator.cli.processes import OrchestratorProcess, StageProcess
from orchestrator.client import AsyncClient
from services.testing.configs import SMOLLM2, TINY_LLAMA


def stage_file(folder: Path, cache: str) -> Path:
    config = {
        "name": "solo",
        "engine": "transformers",
        "model": SMOLLM2,
        "cache_dir": cache,
        "load_format": "dummy",
        "engine_args": {"config_overrides": TINY_LLAMA},
        "defaults": {"temperature": 0.0},
        "runtime": {"torch_threads": 1, "max_batch_size": 8, "max_queue_size": 256},
        "segmenting": {"max_segment_tokens": 1, "min_flush_interval_ms": 0},
    }
    path = folder / "solo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wave(
    orchestrators: list[OrchestratorProcess], args: argparse.Namespace
) -> dict[str, Any]:
    """One wave of requests through ``orchestrators``: its throughput and their CPU."""
    async with AsyncClient([o.address for o in orchestrators]) as client:
        await client.wait_ready(timeout_s=300)
        gate = asyncio.Semaphore(args.concurrency)
        params = {"max_tokens": args.tokens}

        async def one(index: int) -> int:
            async with gate:
                result = await client.generate(f"Say {index}.", params=params).collect()
                assert result.ok, result.done
                return sum(1 for _ in result.stages["solo"].token_ids)

        cpu_before = [cpu_seconds(o.pid) for o in orchestrators]
        began = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - began
        cpu = [cpu_seconds(o.pid) - b for o, b in zip(orchestrators, cpu_before, strict=True)]
    outputs = sum(tokens)
    return {
        "wall_s": wall,
        "requests_per_s": args.requests / wall,
        "outputs_per_s": outputs / wall,
        "orchestrator_cpu_s": cpu,
        "requests_per_cpu_s": args.requests / sum(cpu),
        "outputs_per_cpu_s": outputs / sum(cpu),
    }


async def with_orchestrators(
    count: int, pipeline: Path, folder: Path, args: argparse.Namespace
) -> dict[str, Any]:
    ports = [free_port() for _ in range(count)]
    peers = ["--peers", "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)] if count > 1 else []
    logs = [(folder / f"orchestrator-{count}-{i}.log").open("ab") for i in range(count)]
    processes = [
        OrchestratorProcess(pipeline, port=p, args=peers, log=log)
        for p, log in zip(ports, logs, strict=True)
    ]
    try:
        for process in processes:
            await process.start()
        return await wave(processes, args)
    finally:
        await asyncio.gather(*(p.stop(2.0) for p in processes))
        for log in logs:
            log.close()


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        config = stage_file(folder, args.cache_dir)
        stages = [StageProcess(config) for _ in range(args.stages)]
        try:
            addresses = []
            for stage in stages:  # one by one: several importing torch at once crawl
                addresses.append(await stage.start(timeout_s=300))
            pipeline = folder / "pipeline.yaml"
            solo = {"name": "solo", "address": "ipv4:" + ",".join(addresses)}
            pipeline.write_text(yaml.safe_dump({"name": "carry", "stages": [solo]}))
            runs = []
            for _ in range(args.runs):  # one and two side by side in each run
                runs.append(
                    {str(n): await with_orchestrators(n, pipeline, folder, args) for n in (1, 2)}
                )
        finally:
            await asyncio.gather(*(s.stop(2.0) for s in stages))
    rows = []
    for n in ("1", "2"):
        figures = [run[n] for run in runs]
        rows.append(
            {
                "orchestrators": n,
                "requests/s": span([f["requests_per_s"] for f in figures]),
                "outputs/s": span([f["outputs_per_s"] for f in figures]),
                "orch CPU s": span([sum(f["orchestrator_cpu_s"]) for f in figures]),
                "requests/CPU-s": span([f["requests_per_cpu_s"] for f in figures]),
                "outputs/CPU-s": span([f["outputs_per_cpu_s"] for f in figures]),
            }
        )
    ratio = [run["2"]["requests_per_s"] / run["1"]["requests_per_s"] for run in runs]
    print(table(rows, list(rows[0])))
    print(f"\ntwo over one, requests/s: {span(ratio)} (cores: {os.cpu_count()})")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path = write_json("orchestrators", {"args": settings, "runs": runs}, args.out)
    print(f"written to {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache-dir", default=".cache")
    parser.add_argument("--out", type=Path)
    arguments = parser.parse_args()
    arguments.cache_dir = str(Path(arguments.cache_dir).resolve())
    asyncio.run(main(arguments))
