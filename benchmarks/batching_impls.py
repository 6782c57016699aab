"""Which batching loop the transformers engine should use, measured on this CPU.

    python benchmarks/batching_impls.py [--rounds 3] [--max-tokens 32] [--threads N]
        [--weights auto|gguf_blocks|packed|plain]

Side by side, in-process, SmolLM2-135M greedy, N prompts at once (N = 1, 4, 8):

- ``engine``: our scheduler (services/engines/scheduler) and runner through
  ``TransformersEngine.generate``, N concurrent requests;
- ``hf-cb``: transformers' own continuous batching (``model.generate_batch``, the
  paged ``ContinuousBatchingManager``);
- ``hf-generate``: plain ``model.generate`` on one left-padded batch (static
  batching: the ceiling the issue quotes).

All three run the engine's model, its linear weights held as ``--weights`` says
(``engine_args.weights``; default ``packed``: packed once for oneDNN).
Prints aggregate tokens/s per implementation and batch size; rounds alternate
the implementations so drift on a shared machine hits all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any, get_args

import torch

from benchmarks._common import median, table, write_json
from services.engines.base import EngineRequest, EngineSettings, SamplingParams, TokenOutput
from services.engines.capabilities import planned
from services.engines.transformers import TransformersEngine
from services.engines.transformers.config import TransformersArgs
from services.mesh import environment
from services.stage.startup.fetch import fetch_model
from services.testing.configs import SMOLLM2

# engine_args.weights of the transformers engine: auto, gguf_blocks, packed, plain.
WEIGHTS = get_args(TransformersArgs.model_fields["weights"].annotation)
PROMPTS = [
    f"Write a long paragraph about {t}."
    for t in ("the sea", "copper", "bees", "owls", "trains", "clouds", "chess", "tea")
]


class _Quiet:
    def start(self, *a: object) -> None: ...
    def progress(self, *a: object) -> None: ...
    def done(self, *a: object) -> None: ...
    def preparing(self, *a: object) -> None: ...


async def ours(engine: TransformersEngine, n: int, max_tokens: int) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    async def one(i: int) -> int:
        request = EngineRequest(f"b{i}", messages=(("user", PROMPTS[i]),), params=params)
        # Planned as a stage plans it: the scheduler hears of each arrival first.
        events = engine.generate(await asyncio.to_thread(planned, engine, request))
        return sum([len(e.token_ids) async for e in events if isinstance(e, TokenOutput)])

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


def hf_cb(model: Any, ids: list[list[int]], max_tokens: int) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1)
    out = model.generate_batch(ids, generation_config=config, warmup=False)
    return sum(len(r.generated_tokens) for r in out.values())


def hf_generate(model: Any, tokenizer: Any, ids: list[list[int]], max_tokens: int) -> int:
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id or 0
    inputs = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=inputs,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return int((out.shape[1] - width) * len(ids))


def _cache_dir() -> Path:
    return environment.CACHE_DIR.get().expanduser()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--weights", choices=WEIGHTS, default="packed")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    cache = _cache_dir()
    path = fetch_model(SMOLLM2, cache, _Quiet()).path
    settings = EngineSettings(
        cache_dir=cache,
        max_batch_size=8,
        engine_args={"weights": args.weights},
    )
    engine = TransformersEngine(settings)
    engine.load(path)
    engine.warmup()
    model, tokenizer = engine.model, engine.tokenizer
    template: Any = tokenizer.apply_chat_template
    ids = [
        list(
            template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for p in PROMPTS
    ]
    samples: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for n in (1, 4, 8):
                for name in ("engine", "hf-cb", "hf-generate"):
                    start = time.perf_counter()
                    if name == "engine":
                        tokens = await ours(engine, n, args.max_tokens)
                    elif name == "hf-cb":
                        tokens = hf_cb(model, ids[:n], args.max_tokens)
                    else:
                        tokens = hf_generate(model, tokenizer, ids[:n], args.max_tokens)
                    rate = tokens / (time.perf_counter() - start)
                    samples.setdefault((name, n), []).append(rate)
    finally:
        engine.close()
    rows = [
        {
            "impl": name,
            "batch": n,
            "tokens/s (median)": median(rates),
            "min": min(rates),
            "max": max(rates),
            "vs its batch 1": median(rates) / median(samples[(name, 1)]),
        }
        for (name, n), rates in samples.items()
    ]
    print(table(rows, ["impl", "batch", "tokens/s (median)", "min", "max", "vs its batch 1"]))
    path = write_json(
        "batching_impls",
        {
            "rows": rows,
            "threads": torch.get_num_threads(),
            "weights": args.weights,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
