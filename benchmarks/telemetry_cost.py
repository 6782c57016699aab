"""What telemetry costs a request: off vs a build without it vs on, side by side.

    python benchmarks/telemetry_cost.py [--rounds 80] [--baseline-commit REV]

Two tiny dummy-weight stages (thinker -> talker, "tokens" transform, 4 tokens
each) run as real processes, telemetry off. Three orchestrator processes front
them, taking turns request by request so drift on the machine spreads evenly:

    without   the orchestrator as built before telemetry existed (--baseline-commit,
              checked out into a temporary worktree)
    off       this build, no OTEL_* / OMNI_PROMETHEUS_PORT set
    on        this build, exporting traces and metrics over OTLP/gRPC to a sink on
              127.0.0.1 (it accepts and drops everything)

Reported: end-to-end p50/p99 per request and each as a ratio to ``without``.
Target: ``off`` within noise of ``without``; ``on`` is the cost of on.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import yaml

from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import OrchestratorProcess, StageProcess
from orchestrator.client import AsyncClient
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import SMOLLM2, TINY_LLAMA

REPO = Path(__file__).resolve().parents[1]
BASELINE = "0d400ee^"  # the commit before telemetry came in


def otlp_sink() -> tuple[grpc.Server, int]:
    """An OTLP/gRPC endpoint that accepts every export and keeps nothing."""

    def accept(_request: bytes, _context: grpc.ServicerContext) -> bytes:
        return b""  # an empty Export*ServiceResponse

    handler = grpc.unary_unary_rpc_method_handler(accept)
    services = [
        grpc.method_handlers_generic_handler(
            f"opentelemetry.proto.collector.{kind}", {"Export": handler}
        )
        for kind in ("trace.v1.TraceService", "metrics.v1.MetricsService")
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=services)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def stage(name: str, folder: Path, cache: str) -> Path:
    config = {
        "name": name,
        "engine": "transformers",
        "model": SMOLLM2,
        "load_format": "dummy",
        "engine_args": {"config_overrides": TINY_LLAMA},
        "cache_dir": cache,
        "defaults": {"temperature": 0.0, "max_tokens": 4},
        "runtime": {"torch_threads": 1},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def one(client: AsyncClient, rid: str) -> float:
    began = time.perf_counter()
    result = await client.generate(
        "Hello there.", params={"max_tokens": 4}, request_id=rid
    ).collect()
    if not result.ok:
        raise RuntimeError(f"{rid}: {result.done}")
    return time.perf_counter() - began


async def run(rounds: int, old: Path, folder: Path) -> dict[str, Any]:
    cache = str(Path.home() / ".cache" / "omni-mesh")
    sink, sink_port = otlp_sink()
    stages = {n: StageProcess(stage(n, folder, cache)) for n in ("thinker", "talker")}
    orchestrators: dict[str, OrchestratorProcess] = {}
    clients: dict[str, AsyncClient] = {}
    try:
        addresses = {n: await p.start() for n, p in stages.items()}
        for address in addresses.values():
            async with StageClient(address) as stage_client:
                await stage_client.wait_ready(timeout_s=300)
        pipeline = folder / "pipe.yaml"
        pipeline.write_text(
            yaml.safe_dump(
                {
                    "name": "cost",
                    "stages": [{"name": n, "address": a} for n, a in addresses.items()],
                    "edges": [{"from": "thinker", "to": "talker", "transform": "tokens"}],
                }
            )
        )
        envs = {
            "without": {"PYTHONPATH": str(old)},
            "off": {"PYTHONPATH": str(REPO)},
            "on": {
                "PYTHONPATH": str(REPO),
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
                "OTEL_EXPORTER_OTLP_INSECURE": "true",
            },
        }
        for label, env in envs.items():
            orchestrators[label] = OrchestratorProcess(pipeline, env=env)
            clients[label] = AsyncClient(await orchestrators[label].start())
            await clients[label].wait_ready(timeout_s=120)
            for i in range(5):  # warm up each path
                await one(clients[label], f"warm-{label}-{i}")
        samples: dict[str, list[float]] = {label: [] for label in envs}
        for r in range(rounds):
            order = list(envs) if r % 2 == 0 else list(reversed(envs))
            for label in order:
                samples[label].append(await one(clients[label], f"{label}-{r}"))
    finally:
        for each in clients.values():
            await each.close()
        for process in [*orchestrators.values(), *stages.values()]:
            await process.stop()
        sink.stop(0)
    base = median(samples["without"])
    rows = []
    for label, values in samples.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        rows.append(
            {
                "orchestrator": label,
                "p50_ms": median(values) * 1e3,
                "p99_ms": p99 * 1e3,
                "p50_vs_without": median(values) / base,
            }
        )
    return {"rounds": rounds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--baseline-commit", default=BASELINE)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "without"
        git = ["git", "-C", str(REPO), "worktree"]
        subprocess.run([*git, "add", "-q", "--detach", str(old), args.baseline_commit], check=True)
        try:
            result = asyncio.run(run(args.rounds, old, Path(tmp)))
        finally:
            subprocess.run([*git, "remove", "--force", str(old)], check=False)
    result["baseline_commit"] = args.baseline_commit
    print(table(result["rows"], ["orchestrator", "p50_ms", "p99_ms", "p50_vs_without"]))
    print(f"json: {write_json('telemetry_cost', result)}")


if __name__ == "__main__":
    main()
