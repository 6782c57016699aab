"""Issue 19's shared-memory findings, replayed against real servers.

- Another local user lists /dev/shm while a stage holds blocks: no block name
  shows. A name that leaked anyway, copied into another request on a stage
  without mesh auth, is refused (the block was made for its own request only).
- A sweep looping in another PID namespace (as a container of a Pod that shares
  /dev/shm but not its processes) while a stage pair hands hidden states over
  by shared memory: no block of the live mesh is removed, no request fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from subprocess import PIPE

import pytest

from services.mesh.data.node import node_identity
from services.mesh.data.shm_dir import SHM_ROOT
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config
from tests.helpers.shm_blocks import remove_mesh
from tests.helpers.stage import collect
from tests.orchestrator.conftest import (
    THINK_TO_RENDER,
    Stages,
    orchestrator,
    pipeline,
    renderer_config,
)

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
REQUESTS, AT_ONCE, TOKENS = 16, 4, 12
# A new PID namespace of its own, where no pid of the mesh exists (without root
# or unshare, the sweeper shares ours: a weaker test, still one that must pass).
NAMESPACE = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
IN_ANOTHER_NAMESPACE = os.geteuid() == 0 and shutil.which("unshare") is not None
# Sweeps until its stdin closes (at most 2 minutes), then says what it saw.
SWEEPER = """
import json, os, select, sys, time
from services.mesh.data.shm_dir import mesh_dir, sweep
mesh = sys.argv[1]
sweeps = removed = seen = 0
deadline = time.monotonic() + 120
while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0.005)[0]:
    removed += sum(name.startswith(f"omni-{mesh}-") for name in sweep(mesh))
    sweeps += 1
    try:
        names = os.listdir(mesh_dir(mesh))
    except FileNotFoundError:
        names = []
    seen = max(seen, sum(name.startswith(f"omni-{mesh}-") for name in names))
print(json.dumps({"sweeps": sweeps, "removed": removed, "seen": seen}), flush=True)
"""


@pytest.fixture
async def open_stage(omni_cache_dir: Path, smollm2_gguf: Path) -> AsyncIterator[StageClient]:
    """A thinker without mesh auth, sending hidden states by shared memory."""
    runtime = {"torch_threads": 1, "inline_max_bytes": 0}
    config = tiny_config("thinker", omni_cache_dir, runtime=runtime)
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=120)
            yield client
    finally:
        await server.stop(1.0)


def prompt_embeds_from(ref: tensor_pb2.Tensor, request_id: str) -> stage_pb2.Submit:
    submit = stage_pb2.Submit(request_id=request_id, is_last=True)
    submit.params.max_tokens = 2
    tensor = submit.inputs.tensors.add()
    tensor.CopyFrom(ref)
    tensor.name = "prompt_embeds"
    return submit


async def test_a_leaked_block_name_is_neither_listed_nor_honoured_in_another_request(
    open_stage: StageClient,
) -> None:
    victim = chat_submit("victim", "Hello there", max_tokens=3, return_hidden_states=True)
    victim.consumer.CopyFrom(node_identity())
    done = (await collect(open_stage.generate(victim)))["victim"]
    refs = [t for s in done.segments for t in s.tensors if t.WhichOneof("data") == "shm"]
    assert refs, "expected the victim's hidden states by shared memory"
    if os.geteuid() == 0:  # as the attack: another uid lists what /dev/shm shows it
        find = await asyncio.create_subprocess_exec(
            "find", str(SHM_ROOT), user=NOBODY, group=NOBODY, stdout=PIPE, stderr=PIPE
        )
        listed = (await find.communicate())[0].decode()
        assert str(SHM_ROOT) in listed and not any(ref.shm.name in listed for ref in refs)
    # The name leaked all the same: sent in another request, it reads nothing.
    stolen = (await collect(open_stage.generate(prompt_embeds_from(refs[0], "mallory"))))["mallory"]
    assert stolen.error is not None and stolen.completed is None
    assert (stolen.error.code_name, stolen.error.field) == (
        "FAILED_PRECONDITION",
        "inputs.tensors[0].shm.name",
    )
    assert "not made for request 'mallory'" in stolen.error.message
    # The ref itself is sound: in the request it was made for, it opens.
    again = (await collect(open_stage.generate(prompt_embeds_from(refs[0], "victim"))))["victim"]
    assert again.error is None and again.completed is not None


@pytest.fixture
async def pair(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[tuple[str, Stages]]:
    """A thinker handing hidden states to a renderer by shared memory, in a mesh of their own."""
    mesh_id = f"siege{uuid.uuid4().hex[:8]}"
    stages = Stages(tmp_path, env={"PYTHONPATH": str(REPO), "OMNI_MESH_ID": mesh_id})
    runtime = {"torch_threads": 1, "max_batch_size": 2, "max_queue_size": 16}
    try:
        await stages.start(
            {
                "thinker": tiny_config(
                    "thinker", omni_cache_dir, runtime={**runtime, "inline_max_bytes": 1024}
                ),
                "renderer": renderer_config(omni_cache_dir, max_queue_size=16),
            }
        )
        yield mesh_id, stages
    finally:
        await stages.stop()
        remove_mesh(mesh_id)


@pytest.mark.slow
async def test_sweeping_a_live_mesh_from_another_pid_namespace_fails_no_request(
    pair: tuple[str, Stages],
) -> None:
    mesh_id, stages = pair
    prefix = NAMESPACE if IN_ANOTHER_NAMESPACE else ()
    sweeper = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-c",
        SWEEPER,
        mesh_id,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=PIPE,
        stdout=PIPE,
    )
    assert sweeper.stdin and sweeper.stdout
    outputs = ["thinker", "renderer"]  # the client's hidden states: read out of blocks too
    config = pipeline(stages, ["thinker", "renderer"], THINK_TO_RENDER, outputs=outputs)
    try:
        async with orchestrator(config, mesh=mesh_id) as (_server, client):
            gate = asyncio.Semaphore(AT_ONCE)

            async def one(i: int):
                async with gate:
                    params = {"max_tokens": TOKENS, "seed": i, "return_hidden_states": True}
                    return await client.generate(
                        f"Draw {i} boats.", params=params, request_id=f"siege-{i}"
                    ).collect()

            results = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        sweeper.stdin.close()
        report = json.loads(await asyncio.wait_for(sweeper.stdout.readline(), 30))
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already: it said its piece
            sweeper.kill()
        await sweeper.wait()
    failed = [r.done for r in results if not r.ok]
    assert failed == [], failed
    for result in results:  # the renderer and the client got every row of hidden states
        thinker = result.stages["thinker"]
        tokens = thinker.completed.usage.completion_tokens
        assert tokens >= 4 and result.stages["renderer"].completed.usage.prompt_tokens == tokens
        rows = sum(t.shape[0] for t in thinker.tensors["hidden_states"])
        assert rows == tokens
    assert report["sweeps"] >= 10 and report["seen"] > 0, report  # it swept while blocks lived
    assert report["removed"] == 0, report
