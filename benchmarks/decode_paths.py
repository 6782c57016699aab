"""The transformers engine's two decode paths for a Llama-shaped GGUF, side by side, on
every kernel variant this CPU runs: the fast CPU runner (a decode step's layer stack
in one call of the kernels) and the reference runner (transformers' own forward over
the same GGUF blocks).

    python benchmarks/decode_paths.py [--runs 3] [--steps 64] [--max-tokens 32]
                                      [--variants avx512 avx2] [--threads N] [--out FILE]

SmolLM2 on its GGUF blocks is loaded twice, once per runner; each run measures, in
an order that rotates, per kernel variant:
- forward: ``--steps`` decode steps of 1 and of 8 rows straight through the runner
  (prompts of one length, so no mask);
- engine: greedy answers of ``--max-tokens`` to the chat prompts through the engine,
  4 one after another (1 concurrent) and 8 at once (prompts of different lengths,
  so the batch is padded and attention runs with its mask).
Reports tokens/s and the stack's ratio to the reference per run; the load average
goes into the JSON. The same figures at ``avx2`` and ``avx512`` say what an AVX2-only
CPU loses against AVX-512 on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import table, write_json
from benchmarks.vs_llamacpp import gguf_path
from services import kernels
from services.engines.base import EngineRequest, EngineSettings, SamplingParams
from services.engines.kv_cache import KvCache, KvShape
from services.engines.transformers import TransformersEngine
from services.engines.transformers.runners import TextRunner
from services.mesh import environment
from services.testing.chat_prompts import CHAT_PROMPTS
from services.testing.engine_runs import collect, generate, tokens_of

PROMPT = [1, 504, 3458, 282, 4013, 314, 253, 3547]  # 8 tokens, every row the same length
RUNNERS = ("auto", "reference")


@torch.inference_mode()
def tokens_per_s(runner: TextRunner, rows: int, steps: int) -> float:
    model = runner.model
    embed = model.get_input_embeddings()
    kv = KvCache(KvShape.of(model.config, model.dtype, model.device), rows)
    ids = torch.tensor([PROMPT] * rows)
    logits, _ = runner.forward(kv, embed(ids), torch.ones_like(ids), False)
    one = torch.ones(rows, 1, dtype=torch.long)
    start = time.perf_counter()
    for _ in range(steps):
        logits, _ = runner.forward(kv, embed(logits.argmax(-1)[:, None]), one, False)
    return rows * steps / (time.perf_counter() - start)


async def engine_tokens_per_s(
    engine: TransformersEngine, concurrent: int, max_tokens: int
) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def answer(i: int) -> int:
        request = EngineRequest(f"g{i}", messages=(("user", CHAT_PROMPTS[i]),), params=params)
        return len(tokens_of(await collect(generate(engine, request))))

    start = time.perf_counter()
    if concurrent == 1:
        tokens = [await answer(i) for i in range(4)]
    else:
        tokens = list(await asyncio.gather(*(answer(i) for i in range(concurrent))))
    return sum(tokens) / (time.perf_counter() - start)


def engine(runner: str) -> TransformersEngine:
    settings = EngineSettings(
        cache_dir=environment.CACHE_DIR.get().expanduser(),
        max_batch_size=8,
        engine_args={"weights": "gguf_blocks", "runner": runner},
    )
    built = TransformersEngine(settings)
    built.load(gguf_path())
    built.warmup()
    return built


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--variants", nargs="+", help="kernel variants (default: all runnable)")
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants or [v for v in kernels.runnable() if v != "reference"]
    engines = {runner: engine(runner) for runner in RUNNERS}
    # Warm every path for seconds, not steps: the first seconds after loading ran at
    # about 1 token/s here (the weights' pages coming in).
    warm_until = time.perf_counter() + 10
    while time.perf_counter() < warm_until:
        for built in engines.values():
            for rows in (1, 8):
                tokens_per_s(built.runner, rows, 4)
    results: list[dict[str, Any]] = []
    for run in range(args.runs):
        for variant in variants[run % len(variants) :] + variants[: run % len(variants)]:
            with kernels.using(variant):
                order = RUNNERS[run % 2 :] + RUNNERS[: run % 2]
                for kind in ("forward", "engine"):
                    for rows in (1, 8):
                        speed = {}
                        for name in order:
                            if kind == "forward":
                                speed[name] = tokens_per_s(engines[name].runner, rows, args.steps)
                            else:
                                speed[name] = await engine_tokens_per_s(
                                    engines[name], rows, args.max_tokens
                                )
                        results.append(
                            {
                                "measure": kind, "kernels": variant, "run": run, "rows": rows,
                                "stack tok/s": speed["auto"],
                                "reference tok/s": speed["reference"],
                                "stack / reference": speed["auto"] / speed["reference"],
                            }
                        )  # fmt: skip
    for built in engines.values():
        built.close()
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print(table(results, list(results[0])))
    print(f"\nwrote {write_json('decode_paths', {'rows': results}, args.out)}")


if __name__ == "__main__":
    asyncio.run(main())
