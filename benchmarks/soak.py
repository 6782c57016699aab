"""A soak: ordinary and hostile traffic together against `omni up` with auth on,
for ``--minutes`` (30 by default), recorded every minute.

    python benchmarks/soak.py [--minutes 30] [--out FILE]

`omni up` runs a tiny dummy-weight stage (SmolLM2's tokenizer on a random 2-layer
Llama) with client tokens on (OMNI_TOKENS_FILE, so the mesh token too) and the
default connection limits. Two ordinary clients send one short request after
another the whole time; a request that fails UNAVAILABLE (its stage was killed)
is retried, as a client of a restarting service would, within 60 s: "ok" is the
share that ended OK, "first" the share that did so on their first try. Each
minute also brings, one after the other:

- a flood: 200 idle HTTP/2 connections, each holding one call that never sends
  a message, half with a token and half without, held 20 s then dropped;
- big unary messages: 4 Generate calls of 32 MB with a token, 4 without;
- slow readers: 4 long requests whose client reads one event, then nothing for
  15 s, then goes away;
- every 5 minutes (and once in a run of less than 5), a SIGKILL of the stage
  (omni up restarts it).

At each minute's end: the orchestrator's (omni up's) and the stage's RSS and
open descriptors, and the ordinary requests' counts, p50 and p99 (end to end,
retries included), and the ordinary requests' errors. Prints a table and writes
JSON (benchmarks/results/soak.json). A 2-minute run is a slow test
(tests/hostile/test_soak.py): >= 99.9 % ok, no growth in descriptors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import table, write_json
from orchestrator.client import AsyncClient
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.security import client_dialing
from tests.helpers.stage import tiny_config, write_config
from tests.hostile.idle_flood import IdleFlood

OMNI = str(Path(sys.executable).parent / "omni")
MB = 1_000_000
RETRY_S = 60.0  # how long an ordinary client retries UNAVAILABLE
COLUMNS = [
    "minute", "requests", "ok %", "first %", "p50 ms", "p99 ms",
    "orch MB", "orch fds", "stage MB", "stage fds", "hostile",
]  # fmt: skip


@dataclass
class Minute:
    latencies: list[float] = field(default_factory=list)  # of those that ended OK
    requests: int = 0
    first_try: int = 0
    hostile: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)  # of the ordinary that failed


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Soak:
    def __init__(self, folder: Path, minutes: int) -> None:
        self.folder = folder
        self.minutes = minutes
        self.tokens = {name: secrets.token_hex(20) for name in ("alice", "bob")}
        self.address = ""
        self.up: asyncio.subprocess.Process | None = None
        self.minute = Minute()
        self.rows: list[dict[str, Any]] = []
        self.all_requests = self.all_ok = self.all_first = 0

    async def start(self, cache_dir: Path) -> None:
        entries = [{"name": n, "token": t} for n, t in self.tokens.items()]
        (self.folder / "tokens.yaml").write_text(yaml.safe_dump({"tokens": entries}))
        runtime = {"torch_threads": 1, "max_batch_size": 8, "max_queue_size": 64}
        config = tiny_config("thinker", cache_dir, runtime=runtime)
        stage = write_config(self.folder / "thinker.yaml", config)
        pipeline = {"name": "soak", "stages": [{"name": "thinker", "launch": str(stage)}]}
        (self.folder / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
        self.up = await asyncio.create_subprocess_exec(
            OMNI, "up", str(self.folder / "pipeline.yaml"), "--port", "0",
            "--run-dir", str(self.folder / "run"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "OMNI_TOKENS_FILE": str(self.folder / "tokens.yaml")},
        )  # fmt: skip
        assert self.up.stdout is not None
        while line := (await asyncio.wait_for(self.up.stdout.readline(), 300)).decode():
            if line.startswith("ready in"):
                self.address = line.split()[-1]
                return
        raise RuntimeError("omni up ended before it was ready")

    async def stop(self) -> None:
        if self.up is not None and self.up.returncode is None:
            self.up.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.up.wait(), 60)

    def client(self, who: str | None) -> AsyncClient:
        return AsyncClient(self.address, client_dialing(token=self.tokens[who] if who else None))

    # --- ordinary traffic ---------------------------------------------------------

    async def ordinary(self, index: int, until: float) -> None:
        async with self.client("alice") as alice:
            n = 0
            while time.monotonic() < until:
                n += 1
                await self._one(alice, f"ordinary-{index}-{n}")

    async def _one(self, alice: AsyncClient, rid: str) -> None:
        began = time.monotonic()
        tries, ok = 0, False
        while not ok and time.monotonic() - began < RETRY_S:
            tries += 1
            try:
                result = await alice.generate(
                    "Count to ten.", request_id=rid, params={"max_tokens": 8}, timeout_s=30
                ).collect()
                ok = result.ok
                done = result.done
                code = f"{done.code_name}: {done.message[:80]}" if done is not None else "no Done"
            except grpc.aio.AioRpcError as exc:
                code = f"{exc.code().name}: {(exc.details() or '')[:80]}"
            retry = code.startswith("UNAVAILABLE")
            if not ok and not retry:
                break
            if not ok:
                await asyncio.sleep(0.5)
        self.minute.requests += 1
        if not ok:
            self.minute.errors[code] += 1
        if ok:
            self.minute.latencies.append((time.monotonic() - began) * 1e3)
            self.minute.first_try += tries == 1

    # --- hostile traffic ----------------------------------------------------------

    async def flood(self) -> None:
        host, port = self.address.rsplit(":", 1)
        path = "/omni.v1.Orchestrator/Generate"
        floods = [IdleFlood(host, int(port), 100, path, t) for t in (self.tokens["bob"], "")]
        for flood in floods:
            await asyncio.to_thread(flood.start)
        await asyncio.sleep(20)
        for flood in floods:
            flood.stop()
        self.minute.hostile.append("flood 200")

    async def big_messages(self) -> None:
        request = orchestrator_pb2.GenerateRequest(request_id="big")
        request.inputs.tensors.add(name="x", dtype="uint8", shape=[32 * MB], raw=bytes(32 * MB))
        request.stage_params["nowhere"].max_tokens = 1
        payload = request.SerializeToString()

        async def send(token: str | None) -> None:
            metadata = (("authorization", f"Bearer {token}"),) if token else ()
            options = [("grpc.max_send_message_length", -1)]
            async with grpc.aio.insecure_channel(self.address, options=options) as channel:
                call = channel.unary_stream(
                    "/omni.v1.Orchestrator/Generate", request_serializer=lambda raw: raw
                )(payload, metadata=metadata, timeout=60)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    _ = [event async for event in call]

        await asyncio.gather(*(send(t) for t in [self.tokens["bob"]] * 4 + [None] * 4))
        self.minute.hostile.append("big 8x32MB")

    async def slow_readers(self) -> None:
        async def slow(n: int) -> None:
            async with self.client("bob") as bob:
                params = {"max_tokens": 200}
                events = aiter(
                    bob.generate("Write at length.", request_id=f"slow-{n}", params=params)
                )
                with contextlib.suppress(grpc.aio.AioRpcError, StopAsyncIteration):
                    await anext(events)
                    await asyncio.sleep(15)

        await asyncio.gather(*(slow(n) for n in range(4)))
        self.minute.hostile.append("slow 4")

    def kill_stage(self) -> None:
        assert self.up is not None
        for child in psutil.Process(self.up.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        self.minute.hostile.append("kill stage")

    # --- the run ------------------------------------------------------------------

    def _record(self, minute: int) -> None:
        assert self.up is not None
        orch = psutil.Process(self.up.pid)
        stages = orch.children(recursive=True)
        stage_mb = stage_fds = None
        with contextlib.suppress(psutil.Error, IndexError):
            stage_mb, stage_fds = stages[0].memory_info().rss / MB, stages[0].num_fds()
        m = self.minute
        self.all_requests += m.requests
        self.all_ok += len(m.latencies)
        self.all_first += m.first_try
        self.rows.append(
            {
                "minute": minute,
                "requests": m.requests,
                "ok %": 100 * len(m.latencies) / max(m.requests, 1),
                "first %": 100 * m.first_try / max(m.requests, 1),
                "p50 ms": percentile(m.latencies, 0.5),
                "p99 ms": percentile(m.latencies, 0.99),
                "orch MB": orch.memory_info().rss / MB,
                "orch fds": orch.num_fds(),
                "stage MB": stage_mb,
                "stage fds": stage_fds,
                "hostile": ", ".join(m.hostile),
                "errors": dict(m.errors),
            }
        )
        row = self.rows[-1]
        shown = ", ".join(f"{c} {row[c]}" for c in COLUMNS[1:])
        print(f"minute {minute}: {shown}; errors {row['errors']}", flush=True)
        self.minute = Minute()

    async def run(self) -> dict[str, Any]:
        began = time.monotonic()
        self.minute = Minute()
        self._record(0)  # the baseline, before any traffic
        until = began + 60 * self.minutes
        ordinary = [asyncio.create_task(self.ordinary(i, until)) for i in range(2)]
        for minute in range(1, self.minutes + 1):
            start = began + 60 * (minute - 1)
            await self.flood()
            await self.big_messages()
            if (minute % 5 == 0) if self.minutes >= 5 else (minute == 1):
                self.kill_stage()
            await self.slow_readers()
            await asyncio.sleep(max(0.0, start + 60 - time.monotonic()))
            self._record(minute)
        await asyncio.gather(*ordinary)
        return {
            "minutes": self.minutes,
            "rows": self.rows,
            "requests": self.all_requests,
            "ok_rate": self.all_ok / max(self.all_requests, 1),
            "first_try_rate": self.all_first / max(self.all_requests, 1),
        }


async def soak(minutes: int, cache_dir: Path, out: Path | None = None) -> dict[str, Any]:
    """Run the soak; returns its summary (also printed, and written to ``out``)."""
    with tempfile.TemporaryDirectory(prefix="omni-soak-") as folder:
        run = Soak(Path(folder), minutes)
        try:
            await run.start(cache_dir)
            summary = await run.run()
        finally:
            await run.stop()
    print(f"\n{table(summary['rows'], COLUMNS)}")
    print(
        f"ordinary requests: {summary['requests']}, ok {100 * summary['ok_rate']:.2f} %, "
        f"ok at the first try {100 * summary['first_try_rate']:.2f} %"
    )
    path = write_json("soak", summary, out)
    print(f"wrote {path}")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("OMNI_CACHE_DIR", ".cache"))
    )
    args = parser.parse_args(argv)
    asyncio.run(soak(args.minutes, args.cache_dir.resolve(), args.out))


if __name__ == "__main__":
    main()
