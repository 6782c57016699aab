"""What the `omni` subcommands do (argument parsing lives in cli.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from orchestrator.client import AsyncClient, Result
from orchestrator.outputs import save_outputs
from orchestrator.stages.processes import GatewayProcess, StageProcess
from services.mesh.config_files import ConfigError
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.process import announce, configure_logging, stop_on_signals
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.mesh.security import (
    PLAINTEXT,
    Dialing,
    SecuritySettings,
    client_dialing,
    mesh_dialing,
)
from services.mesh.telemetry import tracing

if TYPE_CHECKING:
    from orchestrator.stages.launcher import Launcher

logger = logging.getLogger("orchestrator")


def _phase_line(event: stage_pb2.InitEvent) -> str:
    phase = stage_pb2.InitPhase.Name(event.phase)
    if event.phase == stage_pb2.DOWNLOAD_PROGRESS:
        if not event.bytes_total:
            return f"[{event.stage}] downloading {event.bytes_done / 1e6:.1f} MB"
        pct = 100 * event.bytes_done / event.bytes_total
        return f"[{event.stage}] downloading {pct:5.1f}% of {event.bytes_total / 1e6:.1f} MB"
    detail = event.reason or event.message
    return f"[{event.stage}] {phase} {detail}".rstrip()


async def run_stage(config: Path, prompt: str, max_tokens: int) -> int:
    """omni stage run: start a stage process, follow it to READY, ask, stop it."""
    with tempfile.NamedTemporaryFile(prefix="omni-stage-", suffix=".log", delete=False) as log:
        stage = StageProcess(config, log=log)
        try:
            address = await stage.start()
            # A stage made secure by OMNI_* env (which it inherits) is dialled the same way.
            dialing = mesh_dialing(SecuritySettings().with_env())
            async with StageClient(address, dialing) as client:
                async for event in client.init_events():
                    print(_phase_line(event), file=sys.stderr, flush=True)
                    if event.phase == stage_pb2.FAILED:
                        print(f"stage log: {log.name}", file=sys.stderr)
                        return 1
                submit = chat_submit("cli-1", prompt, max_tokens=max_tokens)
                async for out in client.generate(submit):
                    kind = out.WhichOneof("kind")
                    if kind == "segment":
                        print(out.segment.text_delta, end="", flush=True)
                    elif kind == "error":
                        error = out.error
                        print(f"\nerror: {error.code_name}: {error.message}", file=sys.stderr)
                        return 1
                print()
            return 0
        finally:
            if await stage.stop() == 0:
                os.unlink(log.name)


def serve_orchestrator(
    pipeline_path: Path,
    host: str,
    port: int,
    flags: dict[str, object] | None = None,
    health_port: int | None = None,
) -> int:
    """omni orchestrator serve: prints `listening HOST:PORT`, stops on SIGTERM/SIGINT.
    Security: the pipeline file's section, then OMNI_* env, then ``flags``."""
    from orchestrator.pipeline import load_pipeline
    from orchestrator.server import OrchestratorServer

    configure_logging()
    try:
        pipeline = load_pipeline(pipeline_path)
        security = pipeline.security.with_env().overridden(flags or {}, "command line")
        tracing.setup(f"omni-orchestrator-{pipeline.name}")
    except (ConfigError, ValueError) as exc:
        print(f"omni orchestrator: {exc}", file=sys.stderr)
        return 2

    async def serve() -> int:
        try:
            server = OrchestratorServer(pipeline, security=security)
        except (ConfigError, ValueError) as exc:  # token files, certificates, OMNI_MESH_ID
            print(f"omni orchestrator: {exc}", file=sys.stderr)
            return 2
        stop = stop_on_signals()
        announce(host, await server.start(host, port, health_port))
        await stop.wait()
        logger.info("orchestrator %s: stopping", pipeline.name)
        await server.stop()
        return 0

    try:
        return asyncio.run(serve())
    except OSError as exc:
        print(f"omni orchestrator: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()


async def generate(
    address: str,
    prompt: str,
    out: Path,
    *,
    request_id: str = "",
    max_tokens: int | None = None,
    seed: int | None = None,
    dialing: Dialing = PLAINTEXT,
    timeout_s: float | None = None,
) -> int:
    """omni generate: stream the output stages' text; save tensors and images."""
    request_id = request_id or uuid.uuid4().hex[:12]
    params: dict[str, object] = {}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if seed is not None:
        params["seed"] = seed
    result = Result(audio_dir=out)  # <out>/<id>-<stage>.wav grows as speech arrives
    try:
        await _stream(address, prompt, params, request_id, result, dialing, timeout_s)
    except grpc.aio.AioRpcError as exc:
        print(f"omni generate: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print()
    done = result.done
    if done is None or done.code != 0:
        what = f"{done.code_name}: {done.message}" if done else "the stream ended without a status"
        print(f"error: {what}", file=sys.stderr)
        return 1
    for path in save_outputs(result, request_id, out):
        print(f"saved {path}", file=sys.stderr)
    return 0


async def _stream(
    address: str,
    prompt: str,
    params: dict[str, object],
    request_id: str,
    result: Result,
    dialing: Dialing,
    timeout_s: float | None,
) -> None:
    """Print the output stages' text as it streams (status lines to stderr)."""
    async with AsyncClient(address, dialing) as client:
        line = ""  # what the terminal line being written shows: "text:STAGE" or "progress"
        events = client.generate(prompt, params=params, request_id=request_id, timeout_s=timeout_s)
        async for event in events:
            result.add(event)
            kind = event.WhichOneof("kind")
            if kind == "segment" and event.segment.text_delta:
                if line != f"text:{event.stage}":
                    if line:
                        print(flush=True)
                    print(f"[{event.stage}] ", end="", file=sys.stderr, flush=True)
                    line = f"text:{event.stage}"
                print(event.segment.text_delta, end="", flush=True)
            elif kind == "progress":
                if line.startswith("text:"):
                    print(flush=True)
                p = event.progress
                step = f"[{event.stage}] step {p.step}/{p.total_steps}"
                if sys.stderr.isatty():  # one line, redrawn
                    print(f"\r{step}", end="", file=sys.stderr, flush=True)
                    line = "progress"
                else:  # logs: a line each
                    print(step, file=sys.stderr, flush=True)
                    line = ""


async def _start_gateway(
    orchestrator: str, host: str, port: int, ca: Path | None, run_dir: Path
) -> GatewayProcess | None:
    """`omni gateway` in front of the orchestrator; prints its base URL once bound."""
    # The child keeps its own descriptor of the log: ours is closed once it started.
    with (run_dir / "gateway.log").open("ab") as log:
        gateway = GatewayProcess(orchestrator, cacert=ca, host=host, port=port, log=log)
        try:
            address = await gateway.start()
        except RuntimeError as exc:
            print(f"omni up: gateway: {exc}", file=sys.stderr)
            return None
    print(f"gateway at http://{address}/v1 (OpenAI-compatible)", flush=True)
    return gateway


def default_pipeline() -> Path:
    """examples/pipelines/default.yaml of the working directory, else the one shipped
    inside the package (a checkout and an installed wheel alike)."""
    relative = Path("examples/pipelines/default.yaml")
    if relative.is_file():
        return relative
    return bundled_examples() / "pipelines" / "default.yaml"


def bundled_examples() -> Path:
    """The example pipelines and stage files, installed as package data."""
    # Located through the package, not this file, so the module may move.
    return Path(str(resources.files("orchestrator") / "examples"))


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
) -> int:
    """omni up: start every stage and the orchestrator, show progress until ready;
    then answer ``prompt`` and stop, or serve until SIGTERM/SIGINT. A tokens file
    (the pipeline's, or OMNI_TOKENS_FILE) or ``tls`` turns on auth end to end
    (``stages/mesh_pki.py``). Exit codes: 2 a bad pipeline or stage file (an
    edge's transform its stage does not offer included), 1 any other failure.
    A run folder made here is removed after a clean run, kept (with its logs)
    after a failure; the tokens and keys in it are removed either way. ``http``:
    also an `omni gateway` process on that port, in front of the orchestrator."""
    from orchestrator.pipeline import load_pipeline
    from orchestrator.stages.launcher import Launcher, default_mesh_id
    from orchestrator.stages.mesh_pki import mesh_trust

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
) -> int:
    from orchestrator.stages.processes import ServiceExited
    from orchestrator.stages.progress import ProgressView

    pipeline, run_dir = launcher.pipeline, launcher.run_dir
    stop = stop_on_signals()
    view = ProgressView(list(pipeline.names))
    print(f"omni up: {pipeline.name}, stage logs in {run_dir}", file=sys.stderr, flush=True)
    began = time.monotonic()
    gateway: GatewayProcess | None = None
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
                await asyncio.wait_for(stop.wait(), 0.5)
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
                launcher.address, prompt, out, max_tokens=max_tokens, dialing=dialing
            )
        if http is not None:
            gateway = await _start_gateway(launcher.address, launcher.host, http, ca, run_dir)
            if gateway is None:
                return 1
        await stop.wait()
        return 0
    finally:
        print("omni up: stopping", file=sys.stderr, flush=True)
        if gateway is not None:
            await gateway.stop()
        await launcher.stop()
