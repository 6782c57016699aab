"""The chain benchmarks/mesh_overhead.py measures: three tiny stage processes
and orchestrators over the first k of them (``Mesh``), and one request sent
through an orchestrator or driven by the client itself, stage by stage."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO

import grpc
import yaml

from benchmarks._mesh_relay import RelayProcess
from benchmarks._mesh_report import HOP_TOKENS, STAGES
from orchestrator.cli.processes import OrchestratorProcess, StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import tiny_config, write_config

REPO = Path(__file__).resolve().parents[1]
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "List three uses of copper.",
    "Why is the sky blue?",
)

# One request end to end, by id and index (the index picks prompt and seed):
# (seconds, the last stage's token ids).
Run = Callable[[str, int], Awaitable[tuple[float, list[int]]]]


def params(max_tokens: int, seed: int) -> stage_pb2.GenerationParams:
    return stage_pb2.GenerationParams(max_tokens=max_tokens, seed=seed, temperature=0.0)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used; NaN without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- processes -----------------------------------------------------------------


class Mesh:
    """The stage processes, a client of each, and orchestrators over them: all
    that is started here is stopped by ``close()``, on every path."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.cache_dir = Path(os.environ.get("OMNI_CACHE_DIR") or REPO / ".cache")
        self.stages: dict[str, StageProcess] = {}
        self.clients: dict[str, StageClient] = {}
        self._stack = contextlib.AsyncExitStack()

    def _log(self, name: str) -> IO[bytes]:
        return self._stack.enter_context((self.folder / f"{name}.log").open("wb"))

    async def start_stages(self) -> None:
        runtime = {"torch_threads": 1, "max_batch_size": 1, "max_queue_size": 32}
        defaults = {"temperature": 0.0, "max_tokens": HOP_TOKENS}
        for name in STAGES:
            config = tiny_config(name, self.cache_dir, runtime=runtime, defaults=defaults)
            path = write_config(self.folder / f"{name}.yaml", config)
            stage = self.stages[name] = StageProcess(path, log=self._log(name))
            self._stack.push_async_callback(stage.stop, 5.0)
            client = self.clients[name] = StageClient(await stage.start())
            self._stack.push_async_callback(client.close)
        for client in self.clients.values():
            await client.wait_ready(timeout_s=180)

    @contextlib.asynccontextmanager
    async def orchestrator(self, k: int) -> AsyncIterator[tuple[AsyncClient, int]]:
        """An orchestrator over the first k stages: (a client of it, its pid)."""
        names = STAGES[:k]
        data = {
            "name": f"chain{k}",
            "stages": [{"name": n, "address": self.stages[n].address} for n in names],
            "edges": [
                {"from": a, "to": b, "transform": "tokens"} for a, b in itertools.pairwise(names)
            ],
        }
        parse_pipeline(data, f"chain{k}.yaml")  # a bad file fails here, not in the child
        path = self.folder / f"chain{k}.yaml"
        path.write_text(yaml.safe_dump(data))
        process = OrchestratorProcess(path, log=self._log(f"orchestrator-chain{k}"))
        try:
            async with AsyncClient(await process.start()) as client:
                await client.wait_ready(timeout_s=60)
                yield client, process.pid
        finally:
            await process.stop()

    @contextlib.asynccontextmanager
    async def relay(self) -> AsyncIterator[tuple[AsyncClient, int]]:
        """The bare relay over the first stage (``_mesh_relay``): (a client of it, its pid)."""
        first = STAGES[0]
        process = RelayProcess(self.stages[first].address, first, log=self._log("relay"))
        try:
            async with AsyncClient(await process.start()) as client:
                yield client, process.pid
        finally:
            await process.stop()

    async def close(self) -> None:
        await self._stack.aclose()


# --- one request, both ways ----------------------------------------------------


def orchestrated(client: AsyncClient, k: int, max_tokens: int) -> Run:
    async def run(rid: str, index: int) -> tuple[float, list[int]]:
        stage_params = {name: params(max_tokens, index) for name in STAGES[1:k]}
        start = time.perf_counter()
        result = await client.generate(
            PROMPTS[index % len(PROMPTS)],
            params=params(max_tokens, index),
            stage_params=stage_params,
            request_id=rid,
        ).collect()
        elapsed = time.perf_counter() - start
        if not result.ok:
            raise RuntimeError(f"request {rid}: {result.done}")
        return elapsed, result.stages[STAGES[k - 1]].token_ids

    return run


def direct(clients: list[StageClient], max_tokens: int) -> Run:
    async def run(rid: str, index: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        ids = await call_stage(clients[0], first_submit(rid, index, max_tokens))
        for client in clients[1:]:
            ids = await call_stage(client, token_submit(rid, ids, index, max_tokens))
        return time.perf_counter() - start, ids

    return run


async def call_stage(client: StageClient, submit: stage_pb2.Submit) -> list[int]:
    """One request on its own stream, read through its Completed: what the
    orchestrator does on each stage of a request."""
    call = client.open_stream()
    try:
        await call.write(stage_pb2.StageInput(submit=submit))
        await call.done_writing()
        ids: list[int] = []
        while (out := await call.read()) is not grpc.aio.EOF:
            kind = out.WhichOneof("kind")
            if kind == "segment":
                ids.extend(out.segment.token_ids)
            elif kind == "completed":
                return ids
            elif kind == "error":
                error = out.error
                raise RuntimeError(f"{submit.request_id}: {error.code_name}: {error.message}")
        raise RuntimeError(f"{submit.request_id}: the stage ended its stream before completing")
    finally:
        call.cancel()


def first_submit(rid: str, index: int, max_tokens: int) -> stage_pb2.Submit:
    submit = stage_pb2.Submit(request_id=rid, params=params(max_tokens, index), is_last=True)
    submit.inputs.messages.add(role="user", content=PROMPTS[index % len(PROMPTS)])
    return submit


def token_submit(rid: str, ids: list[int], index: int, max_tokens: int) -> stage_pb2.Submit:
    submit = stage_pb2.Submit(
        request_id=rid, params=params(max_tokens, index), is_last=True, transform="tokens"
    )
    submit.inputs.token_ids.extend(ids)
    return submit


async def burst(run: Run, tag: str, count: int, concurrency: int, *, same: bool = False) -> float:
    """Seconds for ``count`` requests with ``concurrency`` in flight; ``same``:
    all of them request 0, else request i is the i-th."""
    indexes = iter(range(count))

    async def worker() -> None:
        for i in indexes:
            await run(f"{tag}-{i}", 0 if same else i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start
