"""Stage.Generate stream against the same engine called in-process, side by side.

    python benchmarks/stage_stream.py [--rounds 3] [--max-tokens 64] [--out FILE]

1. SmolLM2-135M (real weights): tokens/s and time to first token, through a
   stage process's Generate stream vs. iterating the engine in this process.
2. A tiny dummy-weight Llama: segments/s through one stream with one token per
   segment (the stream's own overhead dominates), vs. the engine's tokens/s.

Runs alternate A/B per round so drift on a shared machine hits both sides.
Target: stream throughput >= 0.97x in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import StageProcess
from services.engines.base import EngineRequest, SamplingParams, TokenOutput
from services.engines.registry import engine_class
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.stage.config import parse_stage_config
from services.testing.configs import SMOLLM2, TINY_LLAMA

TINY = TINY_LLAMA  # SmolLM2's tokenizer on a tiny random-weight Llama
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "List three uses of copper.",
]


def stage_dict(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "transformers",
        "model": SMOLLM2,
        "runtime": {"max_batch_size": 1},
        **extra,
    }


async def in_process(engine: Any, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, total_s, tokens) iterating the engine directly."""
    request = EngineRequest(
        request_id="bench",
        messages=(("user", prompt),),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    plan = await asyncio.to_thread(engine.check, request)  # as a stage plans it
    async for event in engine.generate(plan):
        if isinstance(event, TokenOutput):
            tokens += len(event.token_ids)
            if not first:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start, tokens


async def via_stream(
    client: StageClient, prompt: str, max_tokens: int
) -> tuple[float, float, int, int]:
    """(ttft_s, total_s, tokens, segments) through Stage.Generate."""
    submit = chat_submit("bench", prompt, max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    first = 0.0
    tokens = segments = 0
    async for out in client.generate(submit):
        if out.WhichOneof("kind") == "segment":
            segments += 1
            tokens += len(out.segment.token_ids)
            if out.segment.token_ids and not first:
                first = time.perf_counter() - start
        elif out.WhichOneof("kind") == "error":
            raise RuntimeError(out.error.message)
    return first, time.perf_counter() - start, tokens, segments


async def compare(
    label: str, config: dict[str, Any], prompts: list[str], max_tokens: int, rounds: int, tmp: Path
) -> dict[str, Any]:
    parsed = parse_stage_config(config)
    engine = engine_class("transformers")(parsed.engine_settings())
    from services.stage.startup.fetch import fetch_model

    class _Quiet:
        def start(self, *a: object) -> None: ...
        def progress(self, *a: object) -> None: ...
        def done(self, *a: object) -> None: ...
        def preparing(self, *a: object) -> None: ...

    path = fetch_model(config["model"], parsed.resolved_cache_dir, _Quiet()).path
    await asyncio.to_thread(engine.load, path)
    await asyncio.to_thread(engine.warmup)
    config_file = tmp / f"{config['name']}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    stage = StageProcess(config_file)
    address = await stage.start()
    samples: dict[str, list[tuple[float, float, int, int]]] = {"in-process": [], "stream": []}
    try:
        async with StageClient(address) as client:
            await client.wait_ready(timeout_s=300)
            await via_stream(client, prompts[0], 4)  # connection + first-call warm-up
            await in_process(engine, prompts[0], 4)
            for _ in range(rounds):
                for prompt in prompts:
                    samples["in-process"].append((*await in_process(engine, prompt, max_tokens), 0))
                    samples["stream"].append(await via_stream(client, prompt, max_tokens))
    finally:
        await stage.stop()
        engine.close()
    rows: list[dict[str, Any]] = []
    for side, runs in samples.items():
        tokens = sum(r[2] for r in runs)
        seconds = sum(r[1] for r in runs)
        rows.append(
            {
                "case": label,
                "path": side,
                "tokens": tokens,
                "tokens/s": tokens / seconds,
                "ttft p50 ms": median([r[0] * 1e3 for r in runs]),
                "segments/s": sum(r[3] for r in runs) / seconds if side == "stream" else "",
            }
        )
    rows[1]["vs in-process"] = rows[1]["tokens/s"] / rows[0]["tokens/s"]
    return {"rows": rows}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        real = await compare(
            "SmolLM2-135M",
            stage_dict(
                "smollm2", segmenting={"max_segment_tokens": 8, "min_flush_interval_ms": 50}
            ),
            PROMPTS,
            args.max_tokens,
            args.rounds,
            tmp,
        )
        tiny = await compare(
            "tiny dummy, 1 token/segment",
            stage_dict(
                "tiny",
                load_format="dummy",
                engine_args={"config_overrides": TINY},
                segmenting={"max_segment_tokens": 1, "min_flush_interval_ms": 0},
            ),
            PROMPTS,
            256,
            args.rounds,
            tmp,
        )
    rows = real["rows"] + tiny["rows"]
    print(
        table(
            rows,
            ["case", "path", "tokens", "tokens/s", "ttft p50 ms", "segments/s", "vs in-process"],
        )
    )
    ratio = real["rows"][1]["vs in-process"]
    print(f"\nSmolLM2 stream/in-process throughput: {ratio:.3f} (target >= 0.97)")
    path = write_json(
        "stage_stream", {"rows": rows, "target": {"stream_vs_in_process": 0.97}}, args.out
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
