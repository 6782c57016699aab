"""Which precision the vllm engine's CPU example should run: plain vLLM (its CPU
build) in bfloat16 and in float32 on SmolLM2-135M, greedy, side by side.

    .venv-vllm/bin/python benchmarks/vllm_precision.py [--runs 3] [--out FILE]

Per precision: how many of the 32 fixed chat prompts (services/testing/chat_prompts.py,
32 tokens each) get float32's answer, where each other answer first differs, what
it says to "What is the capital of France?", and speed: the 32 at once (tokens/s
over the batch) and one request alone (64 tokens, tokens/s). Each precision runs in
a process of its own (vLLM starts its own; exiting frees its memory), the two
alternating, ``--runs`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import median, table, write_json
from services.testing.chat_prompts import CHAT_PROMPTS

DTYPES = ("float32", "bfloat16")
MAX_TOKENS = 32
ALONE_TOKENS = 64


def one(dtype: str, out: Path) -> None:
    """In a process of its own: plain vLLM in ``dtype``, answers and speed to ``out``."""
    from services.engines.transformers.loading import converted_folder
    from services.engines.vllm.config import CpuArgs
    from services.mesh import environment

    os.environ.update(CpuArgs().environment())
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.vs_llamacpp import gguf_path

    folder = converted_folder(gguf_path(), environment.CACHE_DIR.get().expanduser())
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def chat(question: str) -> list[int]:
        encoded: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
        )
        return list(encoded["input_ids"])

    prompts = [TokensPrompt(prompt_token_ids=chat(p)) for p in CHAT_PROMPTS]
    llm = LLM(
        model=str(folder), dtype=dtype, max_model_len=2048, enforce_eager=True,
        disable_log_stats=True,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm.generate(prompts[:1], greedy, use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    batch_s = time.perf_counter() - start
    alone = SamplingParams(temperature=0.0, max_tokens=ALONE_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts[1:2], alone, use_tqdm=False)
    alone_s = time.perf_counter() - start
    out.write_text(
        json.dumps(
            {
                "token_ids": [list(o.token_ids) for o in outs],
                "france": outs[0].text,
                "batch_tokens_per_s": sum(len(o.token_ids) for o in outs) / batch_s,
                "alone_tokens_per_s": ALONE_TOKENS / alone_s,
            }
        )
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(dtype: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "answers.json"
        subprocess.run(
            [sys.executable, __file__, "--one", dtype, str(out)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return dict(json.loads(out.read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one[0], Path(args.one[1]))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {d: [] for d in DTYPES}
    for _ in range(args.runs):
        for dtype in DTYPES:
            runs[dtype].append(run(dtype))
    reference = runs["float32"][0]["token_ids"]
    rows = []
    for dtype in DTYPES:
        last = runs[dtype][-1]
        firsts = [first_difference(a, b) for a, b in zip(last["token_ids"], reference, strict=True)]
        differing = {i: f for i, f in enumerate(firsts) if f is not None}
        batch = [r["batch_tokens_per_s"] for r in runs[dtype]]
        alone = [r["alone_tokens_per_s"] for r in runs[dtype]]
        rows.append(
            {
                "dtype": dtype,
                "same as float32": f"{len(firsts) - len(differing)}/{len(firsts)}",
                "first differences (prompt: token)": differing,
                "32 at once tok/s": f"{median(batch):.0f} [{min(batch):.0f}-{max(batch):.0f}]",
                "alone tok/s": f"{median(alone):.0f} [{min(alone):.0f}-{max(alone):.0f}]",
                "capital of France": last["france"],
            }
        )
    print(table(rows, list(rows[0])))
    path = write_json("vllm_precision", {"runs": runs, "rows": rows}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
