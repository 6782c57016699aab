"""What the `omni` subcommands do (argument parsing lives in main.py; `omni up`
in up.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import grpc

from orchestrator.cli.outputs import save_outputs
from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient, Result
from services.mesh.config_files import ConfigError
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.process import announce, configure_logging, stop_on_signals
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.mesh.security import (
    PLAINTEXT,
    Dialing,
    SecuritySettings,
    mesh_dialing,
)
from services.mesh.telemetry import tracing

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
    *,
    peers: str = "",
) -> int:
    """omni orchestrator serve: prints `listening HOST:PORT`, stops on SIGTERM/SIGINT.
    Security: the pipeline file's section, then OMNI_* env, then ``flags``.
    ``peers``: the other orchestrators over the same stages (``orchestrator.server.peers``)."""
    from orchestrator.server.pipeline import load_pipeline
    from orchestrator.server.server import OrchestratorServer

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
            server = OrchestratorServer(pipeline, security=security, peers=peers)
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
    prompt: str | None,
    out: Path,
    *,
    request_id: str = "",
    max_tokens: int | None = None,
    seed: int | None = None,
    dialing: Dialing = PLAINTEXT,
    timeout_s: float | None = None,
    media: Sequence[stage_pb2.ContentPart] = (),
    outputs: Sequence[str] = (),
) -> int:
    """omni generate: stream the output stages' text; save tensors and images.
    ``media``: images and audio sent with the prompt (orchestrator/client/content.py);
    ``outputs``: the output stages wanted (empty: all)."""
    request_id = request_id or uuid.uuid4().hex[:12]
    params: dict[str, object] = {}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if seed is not None:
        params["seed"] = seed
    result = Result(audio_dir=out)  # <out>/<id>-<stage>.wav grows as speech arrives
    try:
        await _stream(
            address, prompt, params, request_id, result, dialing, timeout_s, media, outputs
        )
    except grpc.aio.AioRpcError as exc:
        print(f"omni generate: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except NotHeard as exc:
        print(f"omni generate: {exc}", file=sys.stderr)
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
    prompt: str | None,
    params: dict[str, object],
    request_id: str,
    result: Result,
    dialing: Dialing,
    timeout_s: float | None,
    media: Sequence[stage_pb2.ContentPart] = (),
    outputs: Sequence[str] = (),
) -> None:
    """Print the output stages' text as it streams (status lines to stderr)."""
    async with AsyncClient(address, dialing) as client:
        media = await _heard(client, media, timeout_s)
        line = ""  # what the terminal line being written shows: "text:STAGE" or "progress"
        events = client.generate(
            prompt,
            params=params,
            request_id=request_id,
            timeout_s=timeout_s,
            media=media,
            outputs=outputs,
        )
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


class NotHeard(Exception):
    """A clip the recogniser refused (its message names why)."""


async def _heard(
    client: AsyncClient, media: Sequence[stage_pb2.ContentPart], timeout_s: float | None
) -> Sequence[stage_pb2.ContentPart]:
    """``media`` for a pipeline whose entry stage takes no audio but whose
    recogniser does (the default pipeline): each clip sent to the recogniser
    alone and replaced by its transcript, as the gateway does (docs/api.md,
    "Speech in"). Otherwise as it is: the entry stage takes it or refuses it."""
    if not any(part.WhichOneof("kind") == "audio" for part in media):
        return media
    stages = list((await client.pipeline()).stages)
    if not stages or "audio" in stages[0].accepts:
        return media
    recogniser = next((s.name for s in stages[1:] if "audio" in s.accepts), None)
    if recogniser is None:
        return media
    heard: list[stage_pb2.ContentPart] = []
    for part in media:
        if part.WhichOneof("kind") != "audio":
            heard.append(part)
            continue
        result = await client.generate(
            media=[part], stage=recogniser, timeout_s=timeout_s
        ).collect()
        done = result.done
        if done is None or done.code != 0:
            what = f"{done.code_name}: {done.message}" if done else "no status"
            raise NotHeard(f"--audio: the {recogniser} stage could not hear it: {what}")
        text = result.stages[recogniser].text.strip() if recogniser in result.stages else ""
        print(f"[{recogniser}] {text}", file=sys.stderr, flush=True)
        heard.append(stage_pb2.ContentPart(text=text))
    return heard


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
