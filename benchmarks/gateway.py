"""What the HTTP gateway adds over the Python gRPC client, side by side in one run.

    python benchmarks/gateway.py [--rounds 40] [--stream-tokens 64] [--out FILE]

One stage process, `omni orchestrator serve` and `omni gateway` as their own
processes, as `omni up --http` runs them; this process is the client.

1. Latency of a 16-token chat completion (greedy), p50/p99: the gRPC client
   (`AsyncClient.generate(...).collect()`) vs. the gateway through httpx with a
   kept-alive connection, non-streamed (one JSON body) and streamed (SSE read to
   `[DONE]`). A tiny random-weight Llama (SmolLM2's tokenizer) keeps compute
   small, so what differs is the path. Added = gateway minus gRPC (of the p50s,
   of the p99s, and the median of each round's back-to-back difference); and the
   CPU time a request costs this process plus the gateway's (the gRPC path
   spends none in the gateway), which a busy shared machine disturbs least.
   Beside the gateway as shipped (uvicorn on httptools and uvloop): the same
   gateway on the stack it had before (h11, asyncio's loop), and the floor, a
   bare ASGI app on the shipped stack that relays one Generate and answers the
   least it can (benchmarks/_bare_relay.py): no FastAPI, no validation, no
   OpenAI shapes. The gateway minus the relay is what is ours to remove.
2. Tokens/s of SmolLM2-135M at 1 and 8 concurrent streams: gRPC streams vs.
   the gateway's SSE streams.

The tiny stage sends its 16 tokens as one segment (no flush timer in the
latencies); SmolLM2 segments as the shipped thinker does (8 tokens, or 50 ms).

Runs alternate gRPC / gateway per round, so drift on a shared machine hits both.
Targets: <= 1 ms p50 added; >= 0.95x the gRPC client's tokens/s at 8 concurrent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from benchmarks._common import table, write_json
from orchestrator.cli.processes import (
    GatewayProcess,
    OrchestratorProcess,
    ServiceProcess,
    StageProcess,
)
from orchestrator.client import AsyncClient
from services.testing.configs import SMOLLM2, TINY_LLAMA

PROMPT = "Tell me a long story about a dragon."
OLD_STACK = "gateway on h11+asyncio"
BARE = "bare relay"


def _stage(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "transformers",
        "model": SMOLLM2,
        "defaults": {"temperature": 0.0},
        "runtime": {"max_batch_size": 8, "max_queue_size": 16, "torch_threads": 1},
        # The shipped thinker's (examples/pipelines/stages/thinker.yaml).
        "segmenting": {"max_segment_tokens": 8, "min_flush_interval_ms": 50},
        **extra,
    }


class BareRelay(ServiceProcess):
    """benchmarks/_bare_relay.py: the HTTP + ASGI + one gRPC call floor."""

    def __init__(self, orchestrator: str, **kwargs: Any) -> None:
        super().__init__(Path("bare relay"), **kwargs)
        self.orchestrator = orchestrator

    def command(self) -> list[str]:
        relay = Path(__file__).resolve().parent / "_bare_relay.py"
        return [sys.executable, str(relay), "--orchestrator", self.orchestrator]


class Mesh:
    """A stage, an orchestrator and the HTTP fronts, each its own process: the
    gateway as shipped, the gateway on the stack it had before (h11, asyncio's
    loop), and the bare relay."""

    def __init__(self, folder: Path, stage: dict[str, Any], *, fronts: bool = True) -> None:
        self.folder = folder
        self.stage_file = folder / f"{stage['name']}.yaml"
        self.stage_file.write_text(yaml.safe_dump(stage))
        self.processes: list[ServiceProcess] = []
        self.grpc = ""
        self.http = ""
        self.fronts = fronts
        self.urls: dict[str, str] = {}  # the other fronts' chat URLs
        self.pids: dict[str, int] = {}

    async def __aenter__(self) -> Mesh:
        log = (self.folder / "mesh.log").open("ab")
        stage = StageProcess(self.stage_file, log=log)
        self.processes.append(stage)
        address = await stage.start()
        pipeline = self.folder / "pipeline.yaml"
        name = self.stage_file.stem
        pipeline.write_text(
            yaml.safe_dump({"name": "bench", "stages": [{"name": name, "address": address}]})
        )
        orchestrator = OrchestratorProcess(pipeline, log=log)
        self.processes.append(orchestrator)
        self.grpc = await orchestrator.start()
        async with AsyncClient(self.grpc) as client:
            await client.wait_ready(timeout_s=300)
        gateway = GatewayProcess(self.grpc, log=log)
        self.processes.append(gateway)
        self.http = f"http://{await gateway.start()}/v1/chat/completions"
        self.pids["gateway"] = gateway.pid
        if self.fronts:
            old = GatewayProcess(self.grpc, args=["--http", "h11", "--loop", "asyncio"], log=log)
            bare = BareRelay(self.grpc, log=log)
            for name, front in ((OLD_STACK, old), (BARE, bare)):
                self.processes.append(front)
                self.urls[name] = f"http://{await front.start()}/v1/chat/completions"
                self.pids[name] = front.pid
        return self

    @property
    def gateway_pid(self) -> int:
        return self.pids["gateway"]

    async def __aexit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            await process.stop(5)


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "bench",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
    }


async def grpc_call(client: AsyncClient, max_tokens: int) -> int:
    """One request through the gRPC client; returns its completion tokens."""
    result = await client.generate(PROMPT, params={"max_tokens": max_tokens}).collect()
    if not result.ok or result.done is None:
        raise RuntimeError(f"gRPC request failed: {result.done}")
    return sum(len(stage.token_ids) for stage in result.stages.values())


async def http_call(http: httpx.AsyncClient, url: str, max_tokens: int, stream: bool) -> int:
    """One chat completion through the gateway; returns its completion tokens."""
    body = _body(max_tokens, stream)
    if not stream:
        reply = await http.post(url, json=body)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    async with http.stream("POST", url, json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                tokens = int(json.loads(line[6:])["usage"]["completion_tokens"])
    return tokens


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _timed(call: Callable[[], Awaitable[int]]) -> float:
    began = time.perf_counter()
    await call()
    return (time.perf_counter() - began) * 1e3


def _http_paths(
    mesh: Mesh, http: httpx.AsyncClient
) -> dict[str, tuple[Callable[[], Awaitable[int]], int]]:
    """Each HTTP front, non-streamed and streamed: (the call, the front's pid)."""
    fronts = {"gateway": mesh.http, **mesh.urls}
    paths: dict[str, tuple[Callable[[], Awaitable[int]], int]] = {}
    for name, url in fronts.items():
        for stream in (False, True):

            def call(url: str = url, stream: bool = stream) -> Awaitable[int]:
                return http_call(http, url, 16, stream)

            paths[f"{name}, streamed" if stream else name] = (call, mesh.pids[name])
    return paths


async def latency(mesh: Mesh, rounds: int) -> list[dict[str, Any]]:
    async with AsyncClient(mesh.grpc) as client, httpx.AsyncClient(timeout=60) as http:
        fronts = _http_paths(mesh, http)
        calls: dict[str, Callable[[], Awaitable[int]]] = {
            "gRPC client": lambda: grpc_call(client, 16),
            **{path: call for path, (call, _pid) in fronts.items()},
        }
        pids = {path: pid for path, (_call, pid) in fronts.items()}
        paths: dict[str, list[float]] = {path: [] for path in calls}
        for call in calls.values():  # connections, first-call warm-up
            await call()
        for _ in range(rounds):
            for path, call in calls.items():
                paths[path].append(await _timed(call))
        # CPU time per request, of this process and the gateway's: unlike wall time,
        # what other work on a shared machine changes least.
        cpu: dict[str, float] = {}
        for path, call in calls.items():
            pid = pids.get(path)  # the front's process (the gRPC path has none)
            began = time.process_time(), _cpu_s(pid) if pid else 0.0
            for _ in range(rounds):
                await call()
            front = _cpu_s(pid) - began[1] if pid else 0.0
            cpu[path] = (time.process_time() - began[0] + front) * 1e3 / rounds
    base = paths["gRPC client"]
    rows = []
    for path, ms in paths.items():
        row: dict[str, Any] = {
            "path": path,
            "p50 ms": statistics.median(ms),
            "p99 ms": _percentile(ms, 0.99),
            "cpu ms": cpu[path],
        }
        if path != "gRPC client":
            row["added p50 ms"] = row["p50 ms"] - statistics.median(base)
            row["added p99 ms"] = row["p99 ms"] - _percentile(base, 0.99)
            # Each round's two calls ran back to back: their difference drifts least.
            paired = [g - b for g, b in zip(ms, base, strict=True)]
            row["paired median ms"] = statistics.median(paired)
        rows.append(row)
    return rows


async def throughput(mesh: Mesh, rounds: int, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    async with AsyncClient(mesh.grpc) as client, httpx.AsyncClient(timeout=300) as http:
        await grpc_call(client, 4)
        await http_call(http, mesh.http, 4, True)
        for streams in (1, 8):
            done: dict[str, list[tuple[int, float]]] = {"gRPC client": [], "gateway": []}
            calls: dict[str, Callable[[], Awaitable[int]]] = {
                "gRPC client": lambda: grpc_call(client, max_tokens),
                "gateway": lambda: http_call(http, mesh.http, max_tokens, True),
            }
            for _ in range(rounds):
                for path, call in calls.items():
                    began = time.perf_counter()
                    tokens = await asyncio.gather(*(call() for _ in range(streams)))
                    done[path].append((sum(tokens), time.perf_counter() - began))
            rates = {p: sum(t for t, _ in r) / sum(s for _, s in r) for p, r in done.items()}
            for path, rate in rates.items():
                row: dict[str, Any] = {"streams": streams, "path": path, "tokens/s": rate}
                if path == "gateway":
                    row["vs gRPC"] = rate / rates["gRPC client"]
                rows.append(row)
    return rows


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="latency samples per path")
    parser.add_argument("--stream-rounds", type=int, default=3, help="throughput rounds")
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tiny = _stage(
            "tiny",
            load_format="dummy",
            engine_args={"config_overrides": TINY_LLAMA},
            # One segment at the end: no flush timer in the numbers, only the path.
            segmenting={"max_segment_tokens": 16, "min_flush_interval_ms": 60_000},
        )
        (folder / "tiny").mkdir()
        async with Mesh(folder / "tiny", tiny) as mesh:
            latencies = await latency(mesh, args.rounds)
        (folder / "smollm2").mkdir()
        async with Mesh(folder / "smollm2", _stage("smollm2"), fronts=False) as mesh:
            rates = await throughput(mesh, args.stream_rounds, args.stream_tokens)
    print("16-token chat completion, tiny model (ms)")
    columns = ["path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "paired median ms"]
    columns.append("cpu ms")
    print(table(latencies, columns))
    print(f"\nSmolLM2-135M, {args.stream_tokens} tokens a stream")
    print(table(rates, ["streams", "path", "tokens/s", "vs gRPC"]))
    added = latencies[1]["added p50 ms"]
    ratio = next(r["vs gRPC"] for r in rates if r["streams"] == 8 and "vs gRPC" in r)
    print(f"\nadded p50: {added:.2f} ms (target <= 1); 8 streams: {ratio:.3f}x (target >= 0.95)")
    targets = {"added_p50_ms": 1.0, "tokens_per_s_vs_grpc_at_8": 0.95}
    path = write_json(
        "gateway", {"latency": latencies, "throughput": rates, "target": targets}, args.out
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
