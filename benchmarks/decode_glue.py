"""The lean forward's decode steps with its glue in C against torch's ops, side by side.

    python benchmarks/decode_glue.py [--runs 3] [--steps 64] [--out FILE]

SmolLM2 on its GGUF blocks (float32, the lean forward) is loaded once; each run
decodes ``--steps`` tokens for 1 and for 8 rows (prompts of one length, so no mask:
the case the C attention takes) once with the C glue (fused_ops.py) and once with
torch's ops, in alternating order, through KvRows as the engine's step loop calls
it. Reports tokens/s of each and their ratio per run; the machine's load average
goes into the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import table, write_json
from benchmarks.vs_llamacpp import gguf_path
from services.engines.base import EngineSettings
from services.engines.transformers.config import TransformersArgs
from services.engines.transformers.kv_rows import KvRows
from services.engines.transformers.lean_forward import LeanForward, lean_of
from services.engines.transformers.loading import load_model
from services.mesh import environment

PROMPT = [1, 504, 3458, 282, 4013, 314, 253, 3547]  # 8 tokens, every row the same length


@torch.inference_mode()
def tokens_per_s(model: Any, lean: LeanForward, fused: bool, rows: int, steps: int) -> float:
    lean.fused = fused
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = EngineSettings(
        cache_dir=environment.CACHE_DIR.get().expanduser(),
        engine_args={"weights": "gguf_blocks", "lean_forward": True},
    )
    model = load_model(gguf_path(), settings, TransformersArgs.of(settings), torch.float32).model
    lean = lean_of(model)
    assert lean is not None and lean.fused, "needs the block kernels built (build_ext)"
    # Warm both paths for seconds, not steps: the first seconds after loading ran at
    # about 1 token/s here on either path (the weights' pages coming in).
    warm_until = time.perf_counter() + 10
    while time.perf_counter() < warm_until:
        for rows in (1, 8):
            tokens_per_s(model, lean, True, rows, 4)
            tokens_per_s(model, lean, False, rows, 4)
    results: list[dict[str, Any]] = []
    for run in range(args.runs):
        for rows in (1, 8):
            order = (True, False) if run % 2 == 0 else (False, True)
            speed = {fused: tokens_per_s(model, lean, fused, rows, args.steps) for fused in order}
            results.append(
                {
                    "run": run,
                    "rows": rows,
                    "torch glue tok/s": speed[False],
                    "C glue tok/s": speed[True],
                    "ratio": speed[True] / speed[False],
                }
            )
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print(table(results, list(results[0])))
    print(f"\nwrote {write_json('decode_glue', {'rows': results}, args.out)}")


if __name__ == "__main__":
    main()
