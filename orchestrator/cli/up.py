"""`omni up`: one pipeline on this machine. Starts every stage and the
orchestrator, shows their start-up until ready, then answers a prompt and
stops, or serves (with `omni gateway` in front when asked) until SIGTERM/SIGINT.
Auth, when on, holds end to end (``mesh_pki.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli.commands import generate
from orchestrator.cli.processes import GatewayProcess, Kept
from services.mesh.config_files import ConfigError
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.process import stop_on_signals
from services.mesh.security import PLAINTEXT, Dialing, client_dialing
from services.mesh.telemetry import tracing

if TYPE_CHECKING:
    from orchestrator.cli.launcher import Launcher


async def up(
    pipeline_path: Path,
    *,
    host: str,
    port: int,
    run_dir: Path | None,
    prompt: str | None,
    out: Path,
    max_tokens: int | None,
    tls: bool = False,
    http: int | None = None,
    media: Sequence[stage_pb2.ContentPart] = (),
    gateway_args: Sequence[str] = (),
) -> int:
    """omni up: start every stage and the orchestrator, show progress until ready;
    then answer ``prompt`` and stop, or serve until SIGTERM/SIGINT. A tokens file
    (the pipeline's, or OMNI_TOKENS_FILE) or ``tls`` turns on auth end to end
    (``mesh_pki.py``). Exit codes: 2 a bad pipeline or stage file (an
    edge's transform its stage does not offer included), 1 any other failure.
    A run folder made here is removed after a clean run, kept (with its logs)
    after a failure; the tokens and keys in it are removed either way. ``http``:
    also an `omni gateway` process on that port, in front of the orchestrator
    (``gateway_args``: more of its flags, e.g. ``--max-sessions``)."""
    from orchestrator.cli.launcher import Launcher, default_mesh_id
    from orchestrator.cli.mesh_pki import mesh_trust
    from orchestrator.server.pipeline import load_pipeline

    try:
        pipeline = load_pipeline(pipeline_path)
        settings = pipeline.security.with_env()
        tracing.setup(f"omni-orchestrator-{pipeline.name}")  # the stages set up their own
    except (ConfigError, ValueError) as exc:
        print(f"omni up: {exc}", file=sys.stderr)
        return 2
    made = run_dir is None
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="omni-up-"))
    launched = [s.name for s in pipeline.stages if s.launch is not None]
    try:
        trust = mesh_trust(run_dir, launched, host, settings, tls=tls)
    except (ConfigError, ValueError) as exc:
        print(f"omni up: {exc}", file=sys.stderr)
        return 2
    dialing = PLAINTEXT
    secured: dict[str, Any] = {}
    if trust is not None:
        secured = {"security": trust.orchestrator, "stage_env": trust.stage_env}
        dialing = client_dialing(token=trust.admin_token, ca=trust.ca)
        front = f"TLS (CA {trust.ca})" if trust.ca else "plaintext"
        print(
            f"omni up: auth on: mesh token between orchestrator and stages; front door "
            f"{front}, admin token in {trust.admin_token_file}",
            file=sys.stderr,
            flush=True,
        )
    code = 1
    try:
        code = await _run_up(
            Launcher(
                pipeline,
                run_dir=run_dir,
                mesh_id=default_mesh_id(),
                host=host,
                port=port,
                **secured,
            ),
            prompt,
            out,
            max_tokens,
            dialing,
            http=http,
            ca=trust.ca if trust is not None else None,
            media=media,
            gateway_args=gateway_args,
        )
        return code
    finally:
        if trust is not None:
            trust.remove()
        if made and code == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        tracing.shutdown()


async def _run_up(
    launcher: Launcher,
    prompt: str | None,
    out: Path,
    max_tokens: int | None,
    dialing: Dialing,
    *,
    http: int | None = None,
    ca: Path | None = None,
    media: Sequence[stage_pb2.ContentPart] = (),
    gateway_args: Sequence[str] = (),
) -> int:
    from orchestrator.cli.processes import ServiceExited
    from orchestrator.cli.progress import ProgressView

    pipeline, run_dir = launcher.pipeline, launcher.run_dir
    stop = stop_on_signals()
    view = ProgressView(list(pipeline.names))
    print(f"omni up: {pipeline.name}, stage logs in {run_dir}", file=sys.stderr, flush=True)
    began = time.monotonic()
    gateway: Kept | None = None
    try:
        try:
            server = await launcher.start()
        except ServiceExited as exc:  # a stage that did not start: 2 for a bad stage file
            print(f"omni up: {exc}", file=sys.stderr)
            return 2 if exc.code == 2 else 1
        except (OSError, RuntimeError, ConfigError) as exc:  # a port in use, a bad token file
            print(f"omni up: {exc}", file=sys.stderr)
            return 1
        while True:
            statuses = [m.status for m in server.monitors.values()]
            for status in statuses:
                view.update(status)
            failed = [s for s in statuses if s.state == orchestrator_pb2.STAGE_FAILED]
            if failed:
                for status in failed:
                    print(f"stage {status.name} failed: {status.message}", file=sys.stderr)
                print(f"stage logs: {run_dir}", file=sys.stderr)
                return 2 if server.misconfigured else 1
            if all(s.state == orchestrator_pb2.STAGE_READY for s in statuses):
                await server.wait_ready()  # and described: the orchestrator serves now
                break
            if stop.is_set():
                return 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await stop.wait()
        for name, description in server.descriptions.items():
            if description.load_format == "dummy":
                print(
                    f"note: stage {name} runs with dummy (random) weights; configure a real "
                    "model in its stage file for meaningful output",
                    file=sys.stderr,
                )
        elapsed = time.monotonic() - began
        print(f"ready in {elapsed:.1f}s: orchestrator at {launcher.address}", flush=True)
        if prompt is not None:
            return await generate(
                launcher.address, prompt, out, max_tokens=max_tokens, dialing=dialing, media=media
            )
        if http is not None:
            gateway = await _start_gateway(
                launcher.address, launcher.host, http, ca, run_dir, gateway_args
            )
            if gateway is None:
                return 1
        await stop.wait()
        return 0
    finally:
        print("omni up: stopping", file=sys.stderr, flush=True)
        if gateway is not None:
            await gateway.stop()
        await launcher.stop()


async def _start_gateway(
    orchestrator: str,
    host: str,
    port: int,
    ca: Path | None,
    run_dir: Path,
    args: Sequence[str] = (),
) -> Kept | None:
    """`omni gateway` in front of the orchestrator, restarted (on its port) if it
    dies, as the stages are; prints its base URL once bound."""
    log = (run_dir / "gateway.log").open("ab")  # each restart appends; closed with the gateway
    process = GatewayProcess(orchestrator, cacert=ca, args=args, host=host, port=port, log=log)
    gateway = Kept(process, log)
    try:
        address = await gateway.start()
    except RuntimeError as exc:
        print(f"omni up: gateway: {exc}", file=sys.stderr)
        await gateway.stop()
        return None
    print(f"gateway at http://{address}/v1 (OpenAI-compatible)", flush=True)
    return gateway
