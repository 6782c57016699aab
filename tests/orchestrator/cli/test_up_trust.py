"""`omni up` and its stages as an operator meets them when things go wrong or
must be locked down: a SIGKILLed `omni up` leaves nothing behind, `--tls` runs
the whole mesh with mTLS and tokens, a broken launch file says why, and the
restart backoff starts over after a healthy run."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

from orchestrator.cli.launcher import Launcher
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from services.mesh.data.node import node_identity
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.mesh.security import Dialing, client_dialing
from services.testing.configs import tiny_config, write_config
from tests.helpers.ports import stage_port
from tests.orchestrator.cli.test_up import read_until, shm_blocks

OMNI = str(Path(sys.executable).parent / "omni")


def tiny_pipeline(folder: Path, cache_dir: Path, **runtime: object) -> Path:
    config = tiny_config(
        "thinker", cache_dir, runtime={"torch_threads": 1, "inline_max_bytes": 256, **runtime}
    )
    stage = write_config(folder / "thinker.yaml", config)
    pipeline = {"name": "tiny", "stages": [{"name": "thinker", "launch": str(stage)}]}
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return path


@asynccontextmanager
async def omni_up(
    *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    up = await asyncio.create_subprocess_exec(
        OMNI,
        "up",
        *args,
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=env,
    )
    try:
        assert up.stdout is not None
        ready = await read_until(up.stdout, "ready in", 240)
        yield up, ready.rsplit(" ", 1)[1]
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGTERM)
        await asyncio.wait_for(up.wait(), 60)


async def up_to_the_end(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 240
) -> tuple[int, str]:
    """`omni up ARGS --port 0` run to its end: its exit code and what it said on stderr."""
    up = await asyncio.create_subprocess_exec(
        OMNI,
        "up",
        *args,
        "--port",
        "0",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        _out, err = await asyncio.wait_for(up.communicate(), timeout_s)
    finally:
        if up.returncode is None:
            up.kill()
            await up.wait()
    assert up.returncode is not None
    return up.returncode, err.decode()


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as probe:
        return probe.connect_ex((host, int(port))) == 0


async def test_sigkill_of_up_leaves_no_process_port_or_block(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    pipeline = tiny_pipeline(tmp_path, omni_cache_dir)
    async with omni_up(str(pipeline), "--run-dir", str(tmp_path / "run1")) as (up, address):
        (stage,) = psutil.Process(up.pid).children(recursive=True)
        stage_address = f"127.0.0.1:{stage_port(tmp_path / 'run1', 'thinker')}"
        # Mid-request: a long generation through the orchestrator, and hidden
        # states the stage holds in shared blocks for a consumer on this node.
        async with AsyncClient(address) as client, StageClient(stage_address) as direct:
            events = aiter(client.generate("Write at length.", params={"max_tokens": 2000}))
            assert (await anext(events)).WhichOneof("kind") == "segment"
            submit = chat_submit("held", "Hi", max_tokens=8, return_hidden_states=True)
            submit.consumer.CopyFrom(node_identity())
            outputs = [o async for o in direct.generate(submit)]
            refs = [t.shm.name for o in outputs for t in o.segment.tensors if t.HasField("shm")]
            assert refs and set(refs) <= set(shm_blocks(f"up{up.pid}"))
            up.kill()
            await up.wait()
        # The stage goes by itself (its parent died), and its port with it.
        _gone, alive = psutil.wait_procs([stage], timeout=30)
        assert not alive, "the stage outlived its omni up"
        assert not listening(stage_address)
    # The next omni up (another mesh id) finds nothing of the killed one left.
    async with omni_up(str(pipeline), "--run-dir", str(tmp_path / "run2")):
        assert shm_blocks(f"up{up.pid}") == []


async def test_up_with_tls_runs_the_mesh_with_mtls_and_tokens(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    pipeline = tiny_pipeline(tmp_path, omni_cache_dir)
    run = tmp_path / "run"
    async with omni_up(str(pipeline), "--run-dir", str(run), "--tls") as (_up, address):
        pki = run / "pki"
        assert (pki.stat().st_mode & 0o777) == 0o700
        token = (pki / "admin.token").read_text().strip()
        async with AsyncClient(address, client_dialing(token=token, ca=pki / "ca.pem")) as client:
            result = await client.generate("Hi", params={"max_tokens": 3}).collect()
            assert result.ok, result.done
            assert len(result.stages["thinker"].token_ids) == 3
        async with AsyncClient(address, client_dialing(ca=pki / "ca.pem")) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anonymous.list_stages()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with AsyncClient(address) as plaintext:  # the front door speaks only TLS
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await plaintext.list_stages()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # A stage without the mesh's client certificate refuses the handshake.
        port = stage_port(run, "thinker")
        stranger = Dialing(grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes()))
        async with StageClient(f"127.0.0.1:{port}", stranger) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.describe()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # omni generate speaks TLS with --cacert and a token from the environment.
        generate = await asyncio.create_subprocess_exec(
            OMNI,
            "generate",
            "Hi",
            "--address",
            address,
            "--max-tokens",
            "2",
            "--cacert",
            str(pki / "ca.pem"),
            "--out",
            str(tmp_path / "out"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "OMNI_TOKEN": token},
        )
        _out, err = await asyncio.wait_for(generate.communicate(), 120)
        assert generate.returncode == 0, err.decode()


async def test_up_with_a_broken_launch_file_reports_the_stage_error(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    config = tiny_config("thinker", omni_cache_dir)
    config["engine_args"]["no_such_key"] = 1
    stage = write_config(tmp_path / "thinker.yaml", config)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        yaml.safe_dump({"name": "broken", "stages": [{"name": "thinker", "launch": str(stage)}]})
    )
    code, text = await up_to_the_end(str(pipeline), "--run-dir", str(tmp_path / "run"))
    assert code == 2  # a bad stage file, as `omni stage` itself says
    assert "exited with 2 before binding" in text
    assert f"omni stage: {stage}: engine_args.no_such_key: unknown key; expected one of" in text


async def test_restart_backoff_starts_over_after_a_healthy_run(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    now = [0.0]
    pipeline = parse_pipeline(
        yaml.safe_load(tiny_pipeline(tmp_path, omni_cache_dir).read_text()), "tiny.yaml"
    )
    launcher = Launcher(
        pipeline,
        run_dir=tmp_path / "run",
        mesh_id="backofftest",
        port=0,
        restart_initial_s=0.05,
        healthy_after_s=100.0,
        clock=lambda: now[0],
    )
    await launcher.start()
    try:
        launched = launcher._stages["thinker"]

        async def crash(ran_s: float) -> None:
            restarts = launched.restarts
            process = launched.process
            now[0] += ran_s  # how long it ran, by the launcher's clock
            os.kill(process.pid, signal.SIGKILL)
            # Polled: restarts are the launcher's own business, with no event to wait on.
            while launched.restarts == restarts or launched.process is process:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            while not launched.process.address:  # noqa: ASYNC110
                await asyncio.sleep(0.05)

        await crash(1.0)  # a short run: the backoff grows
        await crash(1.0)
        await crash(500.0)  # a healthy run: it starts over
        assert launched.delays == [0.05, 0.1, 0.05]
    finally:
        await launcher.stop()
