"""The fast CPU runner's decode step on float32 and on 8-bit activations, interleaved,
on every kernel variant this CPU runs: the in-process figure, quieter on a shared
machine than tokens/s through a server.

    python benchmarks/activations_step.py [--runs 5] [--steps 64] [--variants ...]
                                          [--threads N] [--out FILE]

SmolLM2 on its GGUF blocks is loaded twice (``engine_args.activations`` float32 and
int8); each run measures, in an order that rotates, per kernel variant and per
precision, ``--steps`` decode steps of 1 and of 8 rows straight through the runner
(benchmarks/decode_paths.py's ``tokens_per_s``). Reports ms per step, the median and
the range over the runs, and int8's speed-up over float32 per run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import table, write_json
from benchmarks.decode_paths import tokens_per_s
from benchmarks.vs_llamacpp import gguf_path
from services import kernels
from services.engines.base import EngineSettings
from services.engines.transformers import TransformersEngine
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


def spread(values: list[float]) -> str:
    """The median and [min-max] of the runs."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--variants", nargs="+", help="kernel variants (default: all runnable)")
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants or [v for v in kernels.runnable() if v != "reference"]
    engines = {p: engine(p) for p in PRECISIONS}
    ms: dict[tuple[str, str, int], list[float]] = {}
    for run in range(args.runs):
        order = [(v, p) for v in variants for p in PRECISIONS]
        shift = run % len(order)
        for variant, precision in order[shift:] + order[:shift]:
            with kernels.using(variant):
                for rows in ROWS:
                    rate = tokens_per_s(engines[precision].runner, rows, args.steps)
                    ms.setdefault((variant, precision, rows), []).append(rows / rate * 1e3)
    for built in engines.values():
        built.close()
    rows_out: list[dict[str, Any]] = []
    for variant in variants:
        for rows in ROWS:
            f32, i8 = ms[(variant, "float32", rows)], ms[(variant, "int8", rows)]
            ratios = [a / b for a, b in zip(f32, i8, strict=True)]
            rows_out.append(
                {
                    "variant": variant,
                    "rows": rows,
                    "float32 ms/step": spread(f32),
                    "int8 ms/step": spread(i8),
                    "int8 speed-up": spread(ratios),
                }
            )
    print(table(rows_out, list(rows_out[0])))
    raw = {f"{v}/{p}/{r}": t for (v, p, r), t in ms.items()}
    path = write_json(
        "activations_step",
        {"rows": rows_out, "ms": raw, "threads": torch.get_num_threads(),
         "load_average": os.getloadavg()},
        args.out,
    )  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
