"""What the `omni` subcommands do (argument parsing lives in cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from orchestrator.client import AsyncClient, Result
from orchestrator.outputs import save_outputs
from orchestrator.stage_process import StageProcess
from services.mesh.config_files import ConfigError
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.stage_client import StageClient, chat_submit

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
            async with StageClient(address) as client:
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


def serve_orchestrator(pipeline_path: Path, host: str, port: int) -> int:
    """omni orchestrator serve: prints `listening HOST:PORT`, stops on SIGTERM/SIGINT."""
    from orchestrator.pipeline import load_pipeline
    from orchestrator.server import OrchestratorServer

    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        pipeline = load_pipeline(pipeline_path)
    except ConfigError as exc:
        print(f"omni orchestrator: {exc}", file=sys.stderr)
        return 2

    async def serve() -> int:
        server = OrchestratorServer(pipeline)
        bound = await server.start(host, port)
        print(f"listening {host}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("orchestrator %s: stopping", pipeline.name)
        await server.stop()
        return 0

    return asyncio.run(serve())


async def generate(args: argparse.Namespace) -> int:
    """omni generate: stream the output stages' text; save tensors and images."""
    request_id = args.request_id or uuid.uuid4().hex[:12]
    params: dict[str, object] = {}
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens
    if args.seed is not None:
        params["seed"] = args.seed
    result = Result()
    async with AsyncClient(args.address) as client:
        last_stage = ""
        async for event in client.generate(args.prompt, params=params, request_id=request_id):
            result.add(event)
            kind = event.WhichOneof("kind")
            if kind == "segment" and event.segment.text_delta:
                if event.stage != last_stage:
                    prefix = "\n" if last_stage else ""
                    print(f"{prefix}[{event.stage}] ", end="", file=sys.stderr, flush=True)
                    last_stage = event.stage
                print(event.segment.text_delta, end="", flush=True)
            elif kind == "progress":
                p = event.progress
                print(f"\r[{event.stage}] step {p.step}/{p.total_steps}", end="", file=sys.stderr)
    print()
    done = result.done
    if done is None or done.code != 0:
        what = f"{done.code_name}: {done.message}" if done else "the stream ended without a status"
        print(f"error: {what}", file=sys.stderr)
        return 1
    for path in save_outputs(result, request_id, args.out):
        print(f"saved {path}", file=sys.stderr)
    return 0
