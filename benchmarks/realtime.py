"""Time to the first audio delta over /v1/realtime against the same request over
gRPC, side by side in one run, at 1 and at 8 sessions at once.

    python benchmarks/realtime.py [--rounds 20] [--tokens 16] [--out FILE]

The speech pipeline as shipped (examples/pipelines/speech.yaml: the SmolLM2
thinker, greedy, and the hibari speaker on the windowed edge) with
`omni orchestrator serve` and `omni gateway` as their own processes, as `omni up
--http` runs them; this process is the client. Each round sends the same
request both ways, gRPC first or second in turn, so drift on a shared machine
hits both:

    gRPC       AsyncClient.send(GenerateRequest): until the speaker's first audio
    realtime   a WebSocket session (opened and given its user item before the
               clock starts): response.create until the first
               response.output_audio.delta (raw `websockets`, orjson)

Both carry the same messages and max_tokens, so the mesh does the same work;
what differs is the gateway's path (JSON in, the conversation as a
GenerateRequest, each audio segment as base64 PCM in a JSON event, WebSocket
frames). Reported per path and concurrency: p50 and p99 of time to first audio,
added p50 (realtime minus gRPC), the median of each round's paired difference,
and the gateway's CPU time per response (its process, over the realtime rounds
alone). Target: added p50 <= 5 ms at 1 and 8 sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
import websockets
import yaml

from benchmarks._common import table, write_json
from orchestrator.cli.processes import (
    GatewayProcess,
    OrchestratorProcess,
    ServiceProcess,
    StageProcess,
)
from orchestrator.client import AsyncClient
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.testing.configs import SMOLLM2

PROMPT = "Say two short sentences about the sea."
THINKER = {
    "name": "thinker",
    "engine": "transformers",
    "model": SMOLLM2,
    "defaults": {"temperature": 0.0},
    "runtime": {"max_batch_size": 8, "max_queue_size": 32, "torch_threads": 1},
    "segmenting": {"max_segment_tokens": 8, "min_flush_interval_ms": 50},
}
SPEAKER = {
    "name": "speaker",
    "engine": "speech",
    "model": SMOLLM2,
    "engine_args": {"voices": ["heart"]},
    "defaults": {"seed": 0},
    "runtime": {"torch_threads": 1, "streaming_input": True, "max_batch_size": 8},
}
EDGE = {"from": "thinker", "to": "speaker", "window": 4, "first_window": 2, "transform": "tokens"}


class Mesh:
    """Two stage processes, the orchestrator and the gateway, each its own process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: list[ServiceProcess] = []
        self.grpc = ""
        self.ws = ""
        self.gateway_pid = 0

    async def __aenter__(self) -> Mesh:
        log = (self.folder / "mesh.log").open("ab")
        stages = []
        for stage in (THINKER, SPEAKER):
            path = self.folder / f"{stage['name']}.yaml"
            path.write_text(yaml.safe_dump(stage))
            process = StageProcess(path, log=log)
            self.processes.append(process)
            stages.append({"name": stage["name"], "address": await process.start()})
        pipeline = self.folder / "pipeline.yaml"
        body = {
            "name": "bench",
            "stages": stages,
            "edges": [EDGE],
            "outputs": ["thinker", "speaker"],
        }
        pipeline.write_text(yaml.safe_dump(body))
        orchestrator = OrchestratorProcess(pipeline, log=log)
        self.processes.append(orchestrator)
        self.grpc = await orchestrator.start()
        async with AsyncClient(self.grpc) as client:
            await client.wait_ready(timeout_s=300)
        gateway = GatewayProcess(self.grpc, log=log)
        self.processes.append(gateway)
        self.ws = f"ws://{await gateway.start()}/v1/realtime?model=bench"
        self.gateway_pid = gateway.pid
        return self

    async def __aexit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            await process.stop(5)


async def grpc_first_audio(client: AsyncClient, tokens: int) -> float:
    request = orchestrator_pb2.GenerateRequest()
    request.inputs.messages.add(role="user", content=PROMPT)
    request.params.max_tokens = tokens
    began = time.perf_counter()
    first = float("nan")
    async for event in client.send(request):
        if first != first and event.stage == "speaker" and event.WhichOneof("kind") == "segment":
            if any(t.name == "audio" for t in event.segment.tensors):
                first = time.perf_counter() - began
    return first


async def _open(url: str) -> Any:
    """A session with its user item, ready for response.create."""
    ws = await websockets.connect(url, additional_headers={"Authorization": "Bearer x"})
    await _until(ws, "session.created")
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}
    await ws.send(orjson.dumps({"type": "conversation.item.create", "item": item}).decode())
    await _until(ws, "conversation.item.done")
    return ws


async def _until(ws: Any, kind: str) -> None:
    while orjson.loads(await ws.recv())["type"] != kind:
        pass


async def realtime_first_audio(ws: Any, tokens: int) -> float:
    create = {"type": "response.create", "response": {"max_output_tokens": tokens}}
    began = time.perf_counter()
    await ws.send(orjson.dumps(create).decode())
    first = float("nan")
    while True:
        event = orjson.loads(await ws.recv())
        if first != first and event["type"] == "response.output_audio.delta":
            first = time.perf_counter() - began
        if event["type"] == "response.done":
            return first


async def _over_grpc(client: AsyncClient, sessions: int, tokens: int) -> list[float]:
    return list(await asyncio.gather(*(grpc_first_audio(client, tokens) for _ in range(sessions))))


async def _over_ws(
    opened: list[Any], tokens: int, gateway: psutil.Process
) -> tuple[list[float], float]:
    """Each session's time to first audio, and the gateway's CPU seconds meanwhile."""
    before = sum(gateway.cpu_times()[:2])
    times = await asyncio.gather(*(realtime_first_audio(ws, tokens) for ws in opened))
    return list(times), sum(gateway.cpu_times()[:2]) - before


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(mesh: Mesh, sessions: int, rounds: int, tokens: int) -> list[dict[str, Any]]:
    gateway = psutil.Process(mesh.gateway_pid)
    grpc_s: list[float] = []
    ws_s: list[float] = []
    paired: list[float] = []
    cpu_s = 0.0
    async with AsyncClient(mesh.grpc) as client:
        for round_ in range(rounds):
            opened = await asyncio.gather(*(_open(mesh.ws) for _ in range(sessions)))
            if round_ % 2:
                here, spent = await _over_ws(opened, tokens, gateway)
                there = await _over_grpc(client, sessions, tokens)
            else:
                there = await _over_grpc(client, sessions, tokens)
                here, spent = await _over_ws(opened, tokens, gateway)
            cpu_s += spent
            await asyncio.gather(*(ws.close() for ws in opened))
            grpc_s += there
            ws_s += here
            paired += [w - g for w, g in zip(sorted(here), sorted(there), strict=True)]
    ms = 1000.0
    grpc_p50 = statistics.median(grpc_s) * ms
    rows = [
        {"sessions": sessions, "path": "gRPC", "p50 ms": grpc_p50, "p99 ms": _p(grpc_s, 0.99) * ms},
        {
            "sessions": sessions,
            "path": "realtime",
            "p50 ms": statistics.median(ws_s) * ms,
            "p99 ms": _p(ws_s, 0.99) * ms,
            "added p50 ms": statistics.median(ws_s) * ms - grpc_p50,
            "paired median ms": statistics.median(paired) * ms,
            "gateway cpu ms/response": cpu_s * ms / len(ws_s),
        },
    ]
    return rows


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds at 1 session")
    parser.add_argument("--rounds-8", type=int, default=6, help="rounds at 8 sessions")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        async with Mesh(Path(tmp)) as mesh:
            await measure(mesh, 1, 2, args.tokens)  # warm: both paths, both stages
            rows = await measure(mesh, 1, args.rounds, args.tokens)
            rows += await measure(mesh, 8, args.rounds_8, args.tokens)
    print(f"time to first audio, {args.tokens}-token answers (ms)")
    columns = ["sessions", "path", "p50 ms", "p99 ms", "added p50 ms", "paired median ms"]
    print(table(rows, [*columns, "gateway cpu ms/response"]))
    added = {r["sessions"]: r["added p50 ms"] for r in rows if r["path"] == "realtime"}
    print(f"\nadded p50: {added[1]:.2f} ms at 1, {added[8]:.2f} ms at 8 (target <= 5)")
    path = write_json("realtime", {"rows": rows, "target": {"added_p50_ms": 5.0}}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
