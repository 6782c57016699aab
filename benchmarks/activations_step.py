"""The fast CPU runner's decode step on float32 and on 8-bit activations, step by step
interleaved, on every vector kernel variant this CPU runs: the in-process figure,
quieter on a shared machine than tokens/s through a server.

    python benchmarks/activations_step.py [--steps 40] [--rounds 4] [--variants ...]
                                          [--threads N] [--out FILE]

SmolLM2 on its GGUF blocks is loaded twice (``engine_args.activations`` float32 and
int8). Per kernel variant and per batch of 1 and 8 rows (prompts of one length, so
no mask), each round prefills both and then times ``--steps`` decode steps of each,
alternating one step of float32 with one of int8, so that load from elsewhere falls
on both alike. Reports ms per step: the minimum and the 10th percentile (what the step
costs when the machine lets it run; the median moves with other work) and int8's
speed-up at each.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import table, write_json
from benchmarks.decode_paths import PROMPT
from benchmarks.vs_llamacpp import gguf_path
from services import kernels
from services.engines.base import EngineSettings
from services.engines.kv_cache import KvCache, KvShape
from services.engines.transformers import TransformersEngine
from services.engines.transformers.runners import TextRunner
from services.mesh import environment

PRECISIONS = ("float32", "int8")
ROWS = (1, 8)


def engine(activations: str) -> TransformersEngine:
    settings = EngineSettings(
        cache_dir=environment.CACHE_DIR.get().expanduser(),
        max_batch_size=8,
        engine_args={"weights": "gguf_blocks", "activations": activations},
    )
    built = TransformersEngine(settings)
    built.load(gguf_path())
    built.warmup()
    return built


def stepper(runner: TextRunner, rows: int) -> Callable[[], None]:
    """A prefilled batch of ``rows``; each call one greedy decode step."""
    model = runner.model
    embed = model.get_input_embeddings()
    kv = KvCache(KvShape.of(model.config, model.dtype, model.device), rows)
    ids = torch.tensor([PROMPT] * rows)
    last = [runner.forward(kv, embed(ids), torch.ones_like(ids), False)[0]]
    one = torch.ones(rows, 1, dtype=torch.long)

    def step() -> None:
        last[0] = runner.forward(kv, embed(last[0].argmax(-1)[:, None]), one, False)[0]

    return step


def low(ms: list[float]) -> tuple[float, float]:
    """(minimum, 10th percentile)."""
    ordered = sorted(ms)
    return ordered[0], ordered[len(ordered) // 10]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--variants", nargs="+", help="kernel variants (default: all vector)")
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants or [v for v in kernels.runnable() if v != "reference"]
    engines = {p: engine(p) for p in PRECISIONS}
    ms: dict[str, list[float]] = {}
    for variant in variants:
        with kernels.using(variant):
            for rows in ROWS:
                for _ in range(args.rounds):
                    steps = {p: stepper(e.runner, rows) for p, e in engines.items()}
                    for _ in range(args.steps):
                        for precision, step in steps.items():
                            start = time.perf_counter()
                            step()
                            elapsed = (time.perf_counter() - start) * 1e3
                            ms.setdefault(f"{variant}/{rows}/{precision}", []).append(elapsed)
    for built in engines.values():
        built.close()
    rows_out: list[dict[str, Any]] = []
    for variant in variants:
        for rows in ROWS:
            f_min, f_p10 = low(ms[f"{variant}/{rows}/float32"])
            i_min, i_p10 = low(ms[f"{variant}/{rows}/int8"])
            rows_out.append(
                {
                    "variant": variant,
                    "rows": rows,
                    "float32 ms (min, p10)": f"{f_min:.2f}, {f_p10:.2f}",
                    "int8 ms (min, p10)": f"{i_min:.2f}, {i_p10:.2f}",
                    "int8 speed-up (min, p10)": f"{f_min / i_min:.2f}, {f_p10 / i_p10:.2f}",
                }
            )
    print(table(rows_out, list(rows_out[0])))
    path = write_json(
        "activations_step",
        {"rows": rows_out, "ms": ms, "threads": torch.get_num_threads(),
         "load_average": os.getloadavg()},
        args.out,
    )  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
