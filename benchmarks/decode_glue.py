"""The lean forward's decode steps three ways, side by side: torch's ops between the
block products, the C glue (fused_ops.py: one C call per operation), and the decode
stack (decode_stack.py: a step's whole layer stack in one C call).

    python benchmarks/decode_glue.py [--runs 3] [--steps 64] [--max-tokens 32] [--threads N]
                                     [--out FILE]

SmolLM2 on its GGUF blocks (float32, the lean forward) is loaded once, in the
transformers engine; each run measures every path, in an order that rotates:
- forward: ``--steps`` decode steps of 1 and of 8 rows through KvRows, as the step
  loop calls it (prompts of one length, so no mask);
- engine: greedy answers of ``--max-tokens`` to the chat prompts through the engine,
  4 one after another (1 concurrent) and 8 at once (prompts of different lengths, so
  the batch is padded and attention runs with its mask).
Reports tokens/s of each and the ratios to torch's ops per run; the load average goes
into the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import table, write_json
from benchmarks.vs_llamacpp import gguf_path
from services.engines.base import EngineRequest, EngineSettings, SamplingParams
from services.engines.transformers import TransformersEngine
from services.engines.transformers.decode_stack import DecodeStack
from services.engines.transformers.kv_rows import KvRows
from services.engines.transformers.lean_forward import LeanForward, lean_of
from services.mesh import environment
from tests.helpers.chat_prompts import CHAT_PROMPTS
from tests.helpers.engine_runs import collect, generate, tokens_of

PROMPT = [1, 504, 3458, 282, 4013, 314, 253, 3547]  # 8 tokens, every row the same length


PATHS = ("torch", "glue", "stack")


def take(lean: LeanForward, stack: DecodeStack, path: str) -> None:
    """Make the lean forward run ``path``."""
    lean.fused = path != "torch"
    lean.stack = stack if path == "stack" else None


@torch.inference_mode()
def tokens_per_s(model: Any, lean: LeanForward, rows: int, steps: int) -> float:
    embed = model.get_input_embeddings()
    kv = KvRows(model)
    kv.add_rows(rows)
    ids = torch.tensor([PROMPT] * rows)
    logits, _ = kv.forward(embed(ids), torch.ones_like(ids), False)
    one = torch.ones(rows, 1, dtype=torch.long)
    start = time.perf_counter()
    for _ in range(steps):
        logits, _ = kv.forward(embed(logits.argmax(-1)[:, None]), one, False)
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


def row(kind: str, run: int, rows: int, speed: dict[str, float]) -> dict[str, Any]:
    return {
        "measure": kind,
        "run": run,
        "rows": rows,
        "torch ops tok/s": speed["torch"],
        "C glue tok/s": speed["glue"],
        "C stack tok/s": speed["stack"],
        "glue / torch": speed["glue"] / speed["torch"],
        "stack / torch": speed["stack"] / speed["torch"],
        "stack / glue": speed["stack"] / speed["glue"],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = EngineSettings(
        cache_dir=environment.CACHE_DIR.get().expanduser(),
        max_batch_size=8,
        engine_args={"weights": "gguf_blocks", "lean_forward": True},
    )
    engine = TransformersEngine(settings)
    engine.load(gguf_path())
    engine.warmup()
    model = engine.model
    lean = lean_of(model)
    assert lean is not None and lean.fused, "needs the block kernels built (build_ext)"
    stack = lean.stack
    assert stack is not None, f"the decode stack does not apply: {lean.stack_declined}"
    # Warm both paths for seconds, not steps: the first seconds after loading ran at
    # about 1 token/s here on either path (the weights' pages coming in).
    warm_until = time.perf_counter() + 10
    while time.perf_counter() < warm_until:
        for rows in (1, 8):
            for path in PATHS:
                take(lean, stack, path)
                tokens_per_s(model, lean, rows, 4)
    results: list[dict[str, Any]] = []
    for run in range(args.runs):
        order = PATHS[run % 3 :] + PATHS[: run % 3]
        for rows in (1, 8):
            speed = {}
            for path in order:
                take(lean, stack, path)
                speed[path] = tokens_per_s(model, lean, rows, args.steps)
            results.append(row("forward", run, rows, speed))
        for concurrent in (1, 8):
            speed = {}
            for path in order:
                take(lean, stack, path)
                speed[path] = await engine_tokens_per_s(engine, concurrent, args.max_tokens)
            results.append(row("engine", run, concurrent, speed))
    take(lean, stack, "stack")
    engine.close()
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print(table(results, list(results[0])))
    print(f"\nwrote {write_json('decode_glue', {'rows': results}, args.out)}")


if __name__ == "__main__":
    asyncio.run(main())
