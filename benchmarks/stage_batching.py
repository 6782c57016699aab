"""Batching inside a stage: N concurrent requests against the same N one after another.

    python benchmarks/stage_batching.py [--levels 1 2 4 8] [--max-tokens 32] [--rounds 2]
        [--threads N] [--weights packed] [--equality-prompts 32] [--no-text] [--no-images]
        [--out FILE]

Everything goes through a real stage process's Stage.Generate stream (one stream
per request, as separate clients would open them):

1. SmolLM2-135M (real weights, greedy, ``--max-tokens`` each): aggregate tokens/s
   and time to first token (p50/p99, measured by the client) with N concurrent
   requests vs. the same N requests sent one after another, side by side in one
   run. Targets: >= 2.5x tokens/s at 4, >= 4.0x at 8, TTFT p99 at 8 within 3x of
   the median alone.
2. Same answers: ``--equality-prompts`` greedy prompts alone vs. in batches of the
   largest level; how many requests' tokens differ.
3. The dummy diffusers stage (``--images``): images/s, N concurrent vs. in a row.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, get_args

import yaml

from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import StageProcess
from services.engines.transformers.config import TransformersArgs
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.testing.configs import SMOLLM2

# engine_args.weights of the transformers engine: auto, gguf_blocks, packed, plain.
WEIGHTS = get_args(TransformersArgs.model_fields["weights"].annotation)
TOPICS = [
    "the sea", "a CPU cache", "copper", "bees", "volcanoes", "the moon", "bread", "rivers",
    "glass", "owls", "trains", "clouds", "chess", "salt", "bridges", "tea",
]  # fmt: skip
PROMPTS = [f"Write a long paragraph about {t}." for t in TOPICS] + [
    f"Explain in detail how {t} came to be." for t in TOPICS
]


def runtime(max_batch: int, threads: int | None) -> dict[str, Any]:
    keys: dict[str, Any] = {"max_batch_size": max_batch, "max_queue_size": 64}
    if threads is not None:  # else the stage's default: torch's, one per core
        keys["torch_threads"] = threads
    return keys


def llm_stage(max_batch: int, threads: int | None, weights: str) -> dict[str, Any]:
    return {
        "name": "batching-llm",
        "engine": "transformers",
        "model": SMOLLM2,
        "engine_args": {"weights": weights},
        "runtime": runtime(max_batch, threads),
        "segmenting": {"max_segment_tokens": 16, "min_flush_interval_ms": 50},
    }


def image_stage(max_batch: int, threads: int | None) -> dict[str, Any]:
    return {
        "name": "batching-images",
        "engine": "diffusers",
        "load_format": "dummy",
        "engine_args": {"sample_size": 32, "num_inference_steps": 8},
        "runtime": runtime(max_batch, threads),
    }


async def one(client: StageClient, submit: stage_pb2.Submit) -> tuple[float, float, list[int]]:
    """(ttft_s, total_s, token ids) of one request on its own stream."""
    start = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    async for out in client.generate(submit):
        kind = out.WhichOneof("kind")
        if kind == "segment" and (out.segment.token_ids or out.segment.tensors):
            tokens.extend(out.segment.token_ids)
            first = first or time.perf_counter() - start
        elif kind == "error":
            raise RuntimeError(out.error.message)
    return first, time.perf_counter() - start, tokens


async def side_by_side(
    client: StageClient, submits: list[stage_pb2.Submit]
) -> dict[str, tuple[float, list[float], list[list[int]]]]:
    """Both ways for the same submits: (wall seconds, ttfts, token ids per request)."""
    start = time.perf_counter()
    ordered = [await one(client, s) for s in submits]
    in_a_row = time.perf_counter() - start
    start = time.perf_counter()
    together = await asyncio.gather(*(one(client, s) for s in submits))
    concurrent = time.perf_counter() - start
    return {
        "one after another": (in_a_row, [r[0] for r in ordered], [r[2] for r in ordered]),
        "concurrent": (concurrent, [r[0] for r in together], [r[2] for r in together]),
    }


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def text_levels(
    client: StageClient, levels: list[int], max_tokens: int, rounds: int
) -> tuple[list[dict[str, Any]], float]:
    rows: list[dict[str, Any]] = []
    alone_ttft: list[float] = []
    for n in levels:
        submits = [
            chat_submit(f"n{n}-{i}", PROMPTS[i], max_tokens=max_tokens, temperature=0.0)
            for i in range(n)
        ]
        pooled: dict[str, tuple[float, list[float], int]] = {}
        for _ in range(rounds):  # both modes each round, so drift hits both
            for mode, (seconds, ttfts, tokens) in (await side_by_side(client, submits)).items():
                total, all_ttfts, count = pooled.get(mode, (0.0, [], 0))
                pooled[mode] = (total + seconds, all_ttfts + ttfts, count + sum(map(len, tokens)))
        alone_ttft += pooled["one after another"][1]
        base = None
        for mode, (seconds, ttfts, count) in pooled.items():
            rate = count / seconds
            base = base or rate
            rows.append(
                {
                    "case": "SmolLM2 text",
                    "concurrent": n,
                    "mode": mode,
                    "tokens/s": rate,
                    "vs in a row": rate / base,
                    "ttft p50 ms": median(ttfts) * 1e3,
                    "ttft p99 ms": p99(ttfts) * 1e3,
                }
            )
    return rows, median(alone_ttft)


async def equality(client: StageClient, count: int, batch: int) -> dict[str, Any]:
    submits = [
        chat_submit(f"eq-{i}", PROMPTS[i % len(PROMPTS)], max_tokens=16, temperature=0.0)
        for i in range(count)
    ]
    alone = [(await one(client, s))[2] for s in submits]
    batched: list[list[int]] = []
    for i in range(0, count, batch):
        runs = await asyncio.gather(*(one(client, s) for s in submits[i : i + batch]))
        batched += [r[2] for r in runs]
    differ = [i for i, (a, b) in enumerate(zip(alone, batched, strict=True)) if a != b]
    first = [_first_difference(alone[i], batched[i]) for i in differ]
    return {"prompts": count, "batch": batch, "differ": len(differ), "first_diff_at": first}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


async def image_levels(client: StageClient, levels: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in levels:
        submits = [
            stage_pb2.Submit(
                request_id=f"img{n}-{i}",
                inputs=stage_pb2.StageInputs(text=PROMPTS[i]),
                params=stage_pb2.GenerationParams(seed=i),
                is_last=True,
            )
            for i in range(n)
        ]
        runs = await side_by_side(client, submits)
        base = None
        for mode, (seconds, _ttfts, _tokens) in runs.items():
            rate = n / seconds
            base = base or rate
            rows.append(
                {
                    "case": "dummy diffusers",
                    "concurrent": n,
                    "mode": mode,
                    "images/s": rate,
                    "vs in a row": rate / base,
                }
            )
    return rows


async def with_stage(config: dict[str, Any], tmp: Path) -> tuple[StageProcess, StageClient]:
    path = tmp / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    stage = StageProcess(path)
    address = await stage.start()
    client = StageClient(address)
    await client.wait_ready(timeout_s=300)
    return stage, client


async def text_part(args: argparse.Namespace, tmp: Path, payload: dict[str, Any]) -> list[Any]:
    top = max(args.levels)
    stage, client = await with_stage(llm_stage(top, args.threads, args.weights), tmp)
    try:
        await one(client, chat_submit("warm", PROMPTS[0], max_tokens=4, temperature=0.0))
        rows, alone_ttft = await text_levels(client, args.levels, args.max_tokens, args.rounds)
        payload["alone_ttft_ms"] = alone_ttft * 1e3
        if args.equality_prompts:
            payload["equality"] = await equality(client, args.equality_prompts, top)
    finally:
        await client.close()
        await stage.stop()
    return rows


def summarise(rows: list[dict[str, Any]], payload: dict[str, Any], top: int) -> None:
    speedup = {r["concurrent"]: r["vs in a row"] for r in rows if r["mode"] == "concurrent"}
    ttft_top = next(
        r["ttft p99 ms"] for r in rows if r["concurrent"] == top and r["mode"] == "concurrent"
    )
    ttft_ratio = ttft_top / payload["alone_ttft_ms"]
    print(f"\ntokens/s vs in a row: {', '.join(f'{n}: {x:.2f}x' for n, x in speedup.items())}")
    print("(targets: >= 2.5x at 4, >= 4.0x at 8)")
    print(f"TTFT p99 at {top} concurrent / median alone: {ttft_ratio:.2f} (target <= 3)")
    if "equality" in payload:
        eq = payload["equality"]
        print(f"greedy alone vs batched: {eq['differ']} of {eq['prompts']} requests differ")
    payload.update(
        speedup=speedup,
        ttft_p99_top_vs_alone=ttft_ratio,
        target={"speedup_4": 2.5, "speedup_8": 4.0, "ttft_p99_8_vs_alone": 3.0},
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="side-by-side rounds per level")
    parser.add_argument(
        "--threads", type=int, help="torch threads of the stage (default: the stage's own)"
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="packed",
        help="the transformers engine's engine_args.weights (default: oneDNN-packed linears)",
    )
    parser.add_argument("--equality-prompts", type=int, default=32)
    parser.add_argument("--text", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--images", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    top = max(args.levels)
    payload: dict[str, Any] = {
        "threads": args.threads,
        "weights": args.weights,
        "max_tokens": args.max_tokens,
    }
    rows: list[dict[str, Any]] = []
    image_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if args.text:
            rows = await text_part(args, tmp, payload)
        if args.images:
            stage, client = await with_stage(image_stage(top, args.threads), tmp)
            try:
                image_rows = await image_levels(client, args.levels)
            finally:
                await client.close()
                await stage.stop()
    if rows:
        columns = ["case", "concurrent", "mode", "tokens/s", "vs in a row", "ttft p50 ms"]
        print(table(rows, [*columns, "ttft p99 ms"]))
    if image_rows:
        print()
        print(table(image_rows, ["case", "concurrent", "mode", "images/s", "vs in a row"]))
    if rows:
        summarise(rows, payload, top)
    payload.update(rows=rows, image_rows=image_rows)
    path = write_json("stage_batching", payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
