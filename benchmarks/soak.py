"""A soak: ordinary and hostile traffic together against `omni up` with auth on,
for ``--minutes`` (30 by default), recorded every minute (issue 35's contract).

    python benchmarks/soak.py [--minutes 30] [--out FILE] [--seed N]

`omni up` runs a pipeline shaped as the default one, thinker -> renderer and
speaker, light enough for a small machine (``_soak_mesh.py``), with client tokens
on (and so the mesh token) and the default limits. Two ordinary clients send
one short request after another the whole time, each through all three stages;
one that fails UNAVAILABLE (a stage was killed under it) is retried once, as a
client of a restarting service would: "ok" is the share that ended OK, "first"
the share that did so at the first try, "no Done" the requests whose RPC ended
without their Done (every request must end with exactly one). Each minute also
brings, one after the other:

- a flood: 200 idle HTTP/2 connections, each holding one call that never sends
  a message, half with a token and half without, held 20 s then dropped;
- a wave of big unary messages: 8 Generate calls of 60 MB with a token, which
  the orchestrator reads and relays and the thinker refuses (a tensor it does
  not take), and 4 without, refused unread;
- slow readers: 4 long requests whose client reads one event, then nothing for
  15 s, then goes away;
- every 5 minutes (and once in a run of less than 5), a SIGKILL of one stage
  chosen at random (omni up restarts it).

At each minute's end: the orchestrator's (omni up's) and each stage's RSS, the
orchestrator's descriptors, and the ordinary requests' counts, p50 and p99 (end
to end, the retry included). Prints a table and writes JSON
(benchmarks/results/soak.json); the contract: ok >= 99.9 %, no request without
its Done, the orchestrator within 64 MB of its start at every minute after the
first. A 2-minute run is a slow test (tests/hostile/test_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks._common import table, write_json
from benchmarks._soak_mesh import MB, STAGES, Mesh
from orchestrator.client import AsyncClient
from services.mesh.pb.omni.v1 import orchestrator_pb2
from services.mesh.security import client_dialing
from services.testing.idle_flood import IdleFlood

RETRY_AFTER_S = 0.5  # an ordinary client's one retry of UNAVAILABLE waits this long first
REQUEST_TIMEOUT_S = 60.0
WAVE_BYTES = 60 * MB
COLUMNS = [
    "minute", "requests", "ok %", "first %", "no Done", "p50 ms", "p99 ms", "orch MB",
    "orch fds", "thinker MB", "renderer MB", "speaker MB", "wave", "hostile",
]  # fmt: skip


@dataclass
class Minute:
    latencies: list[float] = field(default_factory=list)  # of those that ended OK
    requests: int = 0
    first_try: int = 0
    no_done: int = 0
    hostile: list[str] = field(default_factory=list)
    wave: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # of the ordinary that failed


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Soak:
    def __init__(self, mesh: Mesh, minutes: int, seed: int = 35) -> None:
        self.mesh = mesh
        self.minutes = minutes
        self.random = random.Random(seed)
        self.minute = Minute()
        self.rows: list[dict[str, Any]] = []
        self.all_requests = self.all_ok = self.all_first = self.all_no_done = 0

    def client(self, who: str | None) -> AsyncClient:
        token = self.mesh.tokens[who] if who else None
        return AsyncClient(self.mesh.address, client_dialing(token=token))

    # --- ordinary traffic ---------------------------------------------------------

    async def ordinary(self, index: int, until: float) -> None:
        async with self.client("alice") as alice:
            n = 0
            while time.monotonic() < until:
                n += 1
                await self._one(alice, f"ordinary-{index}-{n}")

    async def _try(self, alice: AsyncClient, rid: str) -> tuple[bool, str, bool]:
        """One try: (ok, what ended it, whether its Done came)."""
        try:
            result = await alice.generate(
                "Count to ten.", request_id=rid, params={"max_tokens": 8},
                timeout_s=REQUEST_TIMEOUT_S,
            ).collect()  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name}: {(exc.details() or '')[:80]}", False
        done = result.done
        if done is None:
            return False, "no Done", False
        return result.ok, f"{done.code_name}: {done.message[:80]}", True

    async def _one(self, alice: AsyncClient, rid: str) -> None:
        began = time.monotonic()
        ok, what, had_done = await self._try(alice, rid)
        first = ok
        if not ok and what.startswith("UNAVAILABLE"):
            await asyncio.sleep(RETRY_AFTER_S)
            ok, what, retried_done = await self._try(alice, rid)
            had_done = had_done and retried_done
        m = self.minute
        m.requests += 1
        m.first_try += first
        m.no_done += not had_done
        if ok:
            m.latencies.append((time.monotonic() - began) * 1e3)
        else:
            m.errors[what] += 1

    # --- hostile traffic ----------------------------------------------------------

    async def flood(self) -> None:
        host, port = self.mesh.address.rsplit(":", 1)
        path = "/omni.v1.Orchestrator/Generate"
        tokens = (self.mesh.tokens["bob"], "")
        floods = [IdleFlood(host, int(port), 100, path, token) for token in tokens]
        for flood in floods:
            await asyncio.to_thread(flood.start)
        await asyncio.sleep(20)
        for flood in floods:
            flood.stop()
        self.minute.hostile.append("flood 200")

    async def wave(self, minute: int) -> None:
        """Eight 60 MB messages with bob's token (read, relayed, refused by the thinker),
        four without (refused unread); their outcomes, by kind, in the row."""

        def payload(rid: str) -> bytes:
            request = orchestrator_pb2.GenerateRequest(request_id=rid)
            raw = bytes(WAVE_BYTES)
            request.inputs.tensors.add(name="x", dtype="uint8", shape=[WAVE_BYTES], raw=raw)
            return request.SerializeToString()

        async def send(rid: str, token: str | None) -> str:
            metadata = (("authorization", f"Bearer {token}"),) if token else ()
            options = [("grpc.max_send_message_length", -1)]
            async with grpc.aio.insecure_channel(self.mesh.address, options=options) as channel:
                call = channel.unary_stream(
                    "/omni.v1.Orchestrator/Generate",
                    request_serializer=lambda raw: raw,
                    response_deserializer=orchestrator_pb2.GenerateEvent.FromString,
                )(payload(rid), metadata=metadata, timeout=120)
                done = None
                try:
                    async for event in call:
                        if event.WhichOneof("kind") == "done":
                            done = event.done
                except grpc.aio.AioRpcError as exc:
                    if done is None:
                        return f"{exc.code().name} unread" if token is None else exc.code().name
                return f"Done {done.code_name}" if done is not None else "no Done"

        bob = self.mesh.tokens["bob"]
        sends = [send(f"wave{minute}-{n}", bob) for n in range(8)]
        sends += [send(f"stranger{minute}-{n}", None) for n in range(4)]
        self.minute.wave.update(await asyncio.gather(*sends))

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

    def kill_a_stage(self) -> None:
        victim = self.random.choice(STAGES)
        self.mesh.kill(victim)
        self.minute.hostile.append(f"kill {victim}")

    # --- the run ------------------------------------------------------------------

    def _record(self, minute: int) -> None:
        m = self.minute
        self.all_requests += m.requests
        self.all_ok += len(m.latencies)
        self.all_first += m.first_try
        self.all_no_done += m.no_done
        memory = self.mesh.memory()
        self.rows.append(
            {
                "minute": minute,
                "requests": m.requests,
                "ok %": 100 * len(m.latencies) / max(m.requests, 1),
                "first %": 100 * m.first_try / max(m.requests, 1),
                "no Done": m.no_done,
                "p50 ms": percentile(m.latencies, 0.5),
                "p99 ms": percentile(m.latencies, 0.99),
                "orch MB": memory["orch"],
                "orch fds": self.mesh.orchestrator.num_fds(),
                **{f"{name} MB": memory[name] for name in STAGES},
                "wave": ", ".join(f"{n} {k}" for k, n in sorted(m.wave.items())),
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
            await self.wave(minute)
            await self.flood()
            if (minute % 5 == 0) if self.minutes >= 5 else (minute == 1):
                self.kill_a_stage()
            await self.slow_readers()
            await asyncio.sleep(max(0.0, start + 60 - time.monotonic()))
            self._record(minute)
        await asyncio.gather(*ordinary)
        start_mb = self.rows[0]["orch MB"]
        later = [row["orch MB"] for row in self.rows[2:]]  # every minute after the first
        return {
            "minutes": self.minutes,
            "rows": self.rows,
            "requests": self.all_requests,
            "ok_rate": self.all_ok / max(self.all_requests, 1),
            "first_try_rate": self.all_first / max(self.all_requests, 1),
            "no_done": self.all_no_done,
            "orch_start_mb": start_mb,
            "orch_most_over_start_mb": max(later, default=start_mb) - start_mb,
        }


async def soak(
    minutes: int, cache_dir: Path, out: Path | None = None, seed: int = 35
) -> dict[str, Any]:
    """Run the soak; returns its summary (also printed, and written to ``out``)."""
    with tempfile.TemporaryDirectory(prefix="omni-soak-") as folder:
        mesh = Mesh(Path(folder))
        try:
            await mesh.start(cache_dir)
            summary = await Soak(mesh, minutes, seed).run()
        finally:
            await mesh.stop()
    print(f"\n{table(summary['rows'], COLUMNS)}")
    print(
        f"ordinary requests: {summary['requests']}, ok {100 * summary['ok_rate']:.2f} %, "
        f"ok at the first try {100 * summary['first_try_rate']:.2f} %, "
        f"without their Done {summary['no_done']}; orchestrator at most "
        f"{summary['orch_most_over_start_mb']:+.0f} MB over its start after minute 1"
    )
    path = write_json("soak", summary, out)
    print(f"wrote {path}")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=35, help="which stage each kill picks")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("OMNI_CACHE_DIR", ".cache"))
    )
    args = parser.parse_args(argv)
    asyncio.run(soak(args.minutes, args.cache_dir.resolve(), args.out, args.seed))


if __name__ == "__main__":
    main()
