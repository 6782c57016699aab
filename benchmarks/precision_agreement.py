"""How often a lower precision changes the transformers engine's greedy answers.

    python benchmarks/precision_agreement.py [--modes bfloat16 float32/gguf_blocks ...] [--out FILE]

A mode is a stage ``dtype``, optionally ``/`` an ``engine_args.weights``, ``/`` an
``engine_args.runner`` (runners/: ``auto``, the fastest that takes the model, or
``reference``) and ``/`` an ``engine_args.activations`` (``float32`` or ``int8``: the
GGUF-block products' activations rounded to 8 bits); the reference is float32 with
oneDNN-packed float32 weights through transformers' own forward
(``float32/packed/reference``).

``dtype: auto`` takes a precision only if its greedy answers equal float32's on
every one of the 32 fixed chat prompts (services/testing/chat_prompts.py), 32 tokens
each, on SmolLM2-135M (services/engines/transformers/config.py, CPU_DIFFERING).
This measures that: per precision, how many of the 32 answers differ and at which
token each first does, and the wall time of the 32 (8 at a time) beside float32's.

``--llama-cpp`` adds llama.cpp's own greedy answers on the same GGUF (``llama-server``
as benchmarks/vs_llamacpp.py finds or builds it, ``--isa``): each prompt sent as the
very token ids our chat template gives (``/completion``, prompt cache off), its
answer's token ids compared like the rest. What llama.cpp's 8-bit activations do to
float32's answers is the yardstick for ours.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import table, write_json
from benchmarks._llamacpp_build import ISA_FLAGS, build_server, find_server
from benchmarks.vs_llamacpp import gguf_path, start_llama
from services.engines.base import EngineRequest, EngineSettings, SamplingParams
from services.engines.transformers import TransformersEngine
from services.mesh import environment
from services.testing.chat_prompts import CHAT_PROMPTS
from services.testing.engine_runs import collect, generate, tokens_of


async def answers(engine: TransformersEngine, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def answer(i: int, prompt: str) -> list[int]:
        request = EngineRequest(f"p{i}", messages=(("user", prompt),), params=params)
        return tokens_of(await collect(generate(engine, request)))

    return list(await asyncio.gather(*(answer(i, p) for i, p in enumerate(CHAT_PROMPTS))))


async def llama_answers(prompts: list[list[int]], max_tokens: int, isa: str) -> list[list[int]]:
    """llama-server's greedy answers to these prompt ids (8 slots, 2 threads)."""
    server = find_server(None, isa) or build_server(isa)
    if server is None:
        raise SystemExit("no llama-server to compare with (see benchmarks/vs_llamacpp.py)")
    llama, url = await start_llama(server, gguf_path())
    try:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:

            async def one(ids: list[int]) -> list[int]:
                body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0,
                        "cache_prompt": False, "return_tokens": True}  # fmt: skip
                reply = await http.post("/completion", json=body)
                reply.raise_for_status()
                return [int(t) for t in reply.json()["tokens"]]

            return list(await asyncio.gather(*(one(ids) for ids in prompts)))
    finally:
        llama.terminate()
        await llama.wait()


def chat_ids(engine: TransformersEngine, prompt: str) -> list[int]:
    """The prompt's token ids as the engine's chat template gives them."""
    encoded = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )  # fmt: skip
    assert isinstance(encoded, Mapping), "return_dict=True gives a mapping"
    return [int(t) for t in encoded["input_ids"]]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=[
            "float32/gguf_blocks/reference",
            "float32/gguf_blocks",
            "float32/gguf_blocks/auto/int8",
            "bfloat16",
        ],
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--llama-cpp", action="store_true", help="compare llama.cpp's answers too")
    parser.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cache = environment.CACHE_DIR.get().expanduser()
    got: dict[str, tuple[float, list[list[int]]]] = {}
    prompts: list[list[int]] = []
    for mode in ["float32/packed/reference", *args.modes]:
        dtype, weights, runner, activations = ([*mode.split("/"), "", "", ""])[:4]
        engine_args = {"weights": weights or "packed", "runner": runner or "auto"}
        if activations:
            engine_args["activations"] = activations
        settings = EngineSettings(
            cache_dir=cache, max_batch_size=8, dtype=dtype, engine_args=engine_args
        )
        engine = TransformersEngine(settings)
        engine.load(gguf_path())
        engine.warmup()
        if not prompts:
            prompts = [chat_ids(engine, prompt) for prompt in CHAT_PROMPTS]
        start = time.perf_counter()
        ids = await answers(engine, args.max_tokens)
        got[mode] = (time.perf_counter() - start, ids)
        engine.close()
    if args.llama_cpp:
        start = time.perf_counter()
        theirs = await llama_answers(prompts, args.max_tokens, args.isa)
        got[f"llama.cpp ({args.isa})"] = (time.perf_counter() - start, theirs)
    base_s, base = got["float32/packed/reference"]
    rows: list[dict[str, Any]] = []
    for mode, (seconds, ids) in got.items():
        firsts = [first_difference(a, b) for a, b in zip(base, ids, strict=True)]
        differing = [f for f in firsts if f is not None]
        rows.append(
            {
                "mode": mode,
                "differ (of 32)": len(differing),
                "first differing token": " ".join(map(str, differing)) or "-",
                "seconds": seconds,
                "speed vs float32": base_s / seconds,
            }
        )
    print(table(rows, list(rows[0])))
    print(f"\nwrote {write_json('precision_agreement', {'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
