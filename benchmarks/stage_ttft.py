"""Time to first token of the chat stage at 1 and 8 concurrent requests, this tree
against another checkout (``--base``), side by side in one run.

    python benchmarks/stage_ttft.py [--base TREE] [--runs 3] [--max-tokens 32] [--out FILE]

Each tree serves ``examples/stages/chat.yaml`` twice, as stage processes: with its
own segmenting (8 tokens / 50 ms, what a user gets) and with segments of one token
(what ``vs_llamacpp.py`` runs, so the engine's part alone). A request is one chat
prompt of services/testing/chat_prompts.py on its own Stage.Generate stream; TTFT is
measured by the client, up to the first Segment that carries tokens. A run sends
8 prompts one after another (1 at once), each prompt to every stage in turn, and
then 8 prompts at once to each stage in turn, the order rotating between runs: on
a machine whose load changes by the second, the stages compared meet the same
load. Reported per stage and level: the median over runs of each run's TTFT p50
(with the runs' range), the median token count of the first segment, and the
stage's own ``time_to_first_ms`` (from Completed).

``--base`` names another checkout of this repository (``git worktree add /tmp/base
main``, with its C extension built or copied in); its stages run that tree's code
(``python -P`` with ``PYTHONPATH`` set to it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.testing.chat_prompts import CHAT_PROMPTS

ROOT = Path(__file__).resolve().parents[1]
# (ttft s, tokens in the first segment, the stage's own time_to_first_ms)
Run = tuple[float, int, float]


class TreeStage(StageProcess):
    """A stage process running the code of ``tree`` (not this checkout's)."""

    def __init__(self, config: Path, tree: Path) -> None:
        super().__init__(config, env={"PYTHONPATH": str(tree)})

    def command(self) -> list[str]:
        # -P: the working directory (this checkout) does not shadow PYTHONPATH's tree.
        return [sys.executable, "-P", "-m", "services.stage", "serve", "--config", str(self.config)]


def stage_file(name: str, one_token: bool, max_tokens: int) -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "examples" / "stages" / "chat.yaml").read_text())
    config["name"] = name
    config["defaults"] = {**config.get("defaults", {}), "max_tokens": max_tokens}
    if one_token:
        config["segmenting"] = {"max_segment_tokens": 1, "min_flush_interval_ms": 0}
    return config


async def one(client: StageClient, submit: stage_pb2.Submit) -> Run:
    start = time.perf_counter()
    ttft, first_tokens, server_ms = 0.0, 0, 0.0
    async for out in client.generate(submit):
        kind = out.WhichOneof("kind")
        if kind == "segment" and out.segment.token_ids and not ttft:
            ttft = time.perf_counter() - start
            first_tokens = len(out.segment.token_ids)
        elif kind == "completed":
            server_ms = out.completed.timings.time_to_first_ms
        elif kind == "error":
            raise RuntimeError(out.error.message)
    return ttft, first_tokens, server_ms


def submit(tag: str, i: int, max_tokens: int) -> stage_pb2.Submit:
    return chat_submit(f"{tag}-{i}", CHAT_PROMPTS[i], max_tokens=max_tokens, temperature=0.0)


async def in_turn(
    clients: dict[str, StageClient], tag: str, max_tokens: int
) -> dict[str, list[Run]]:
    """8 prompts one after another, each to every stage (in ``clients``' order)."""
    got: dict[str, list[Run]] = {name: [] for name in clients}
    for i in range(8):
        for name, client in clients.items():
            got[name].append(await one(client, submit(f"{tag}{name[-3:]}", i, max_tokens)))
    return got


async def at_once(client: StageClient, n: int, tag: str, max_tokens: int) -> list[Run]:
    return list(await asyncio.gather(*(one(client, submit(tag, i, max_tokens)) for i in range(n))))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="another checkout, measured beside this one")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    tmp = Path(tempfile.mkdtemp(prefix="bench-stage-ttft-"))
    procs: list[StageProcess] = []
    clients: dict[str, StageClient] = {}
    samples: dict[tuple[str, int], list[list[Run]]] = {}
    try:
        for tree_name, tree in trees.items():
            for seg_name, one_token in (("chat.yaml", False), ("1-token", True)):
                name = f"{tree_name} {seg_name}"
                path = tmp / f"{tree_name}-{seg_name}.yaml"
                config = stage_file(
                    f"ttft-{tree_name}-{int(one_token)}", one_token, args.max_tokens
                )
                path.write_text(yaml.safe_dump(config))
                stage = TreeStage(path, tree)
                procs.append(stage)
                clients[name] = StageClient(await stage.start(timeout_s=300))
                await clients[name].wait_ready(timeout_s=600)
        names = list(clients)
        for name in names:  # warm each once
            await at_once(clients[name], 8, f"warm-{names.index(name)}", args.max_tokens)
        for r in range(args.runs):
            order = names[r % len(names) :] + names[: r % len(names)]
            results = {
                (name, 1): got
                for name, got in (
                    await in_turn({n: clients[n] for n in order}, f"r{r}n1", args.max_tokens)
                ).items()
            }
            for name in order:
                tag = f"r{r}n8s{names.index(name)}"
                results[name, 8] = await at_once(clients[name], 8, tag, args.max_tokens)
            for (name, n), got in sorted(results.items(), key=lambda item: item[0][1]):
                samples.setdefault((name, n), []).append(got)
                p50 = median([run[0] for run in got]) * 1e3
                print(f"run {r + 1}, {n} at once, {name}: TTFT p50 {p50:.0f} ms", flush=True)
    finally:
        for client in clients.values():
            await client.close()
        for proc in procs:
            await proc.stop()
    rows = report(samples)
    print(table(rows, list(rows[0])))
    payload = {
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "trees": {name: str(tree) for name, tree in trees.items()},
        "rows": rows,
    }
    print(f"\nwrote {write_json('stage_ttft', payload, args.out)}")
    return 0


def report(samples: dict[tuple[str, int], list[list[Run]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for (name, n), runs in samples.items():
        p50s = [median([run[0] for run in got]) * 1e3 for got in runs]
        rows.append(
            {
                "stage": name,
                "concurrent": n,
                "ttft p50 ms": median(p50s),
                "min": min(p50s),
                "max": max(p50s),
                "first segment tokens": median([float(run[1]) for got in runs for run in got]),
                "stage's ttft ms": median([run[2] for got in runs for run in got]),
            }
        )
    rows.sort(key=lambda row: (row["concurrent"], row["stage"]))
    return rows


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
