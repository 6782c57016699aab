"""``omni``: a thin dispatcher.

omni stage serve --config STAGE.yaml [--port N]   run one stage service
omni stage run --config STAGE.yaml "PROMPT"       start a stage, ask it, stop it
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

from orchestrator.stage_process import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.stage_client import StageClient, chat_submit


def _phase_line(event: stage_pb2.InitEvent) -> str | None:
    phase = stage_pb2.InitPhase.Name(event.phase)
    if event.phase == stage_pb2.DOWNLOAD_PROGRESS:
        if not event.bytes_total:
            return f"[{event.stage}] downloading {event.bytes_done / 1e6:.1f} MB"
        pct = 100 * event.bytes_done / event.bytes_total
        return f"[{event.stage}] downloading {pct:5.1f}% of {event.bytes_total / 1e6:.1f} MB"
    detail = event.reason or event.message
    return f"[{event.stage}] {phase} {detail}".rstrip()


async def _run_stage(config: Path, prompt: str, max_tokens: int) -> int:
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
                        print(
                            f"\nerror: {out.error.code_name}: {out.error.message}", file=sys.stderr
                        )
                        return 1
                print()
            return 0
        finally:
            if await stage.stop() == 0:
                os.unlink(log.name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["stage", "serve"]:
        # The stage service's own entry point, in this process: no import of it here.
        os.execv(sys.executable, [sys.executable, "-m", "services.stage", *argv[1:]])
    parser = argparse.ArgumentParser(prog="omni", description="Omni Mesh command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    stage = commands.add_parser("stage", help="one stage service").add_subparsers(
        dest="stage_command", required=True
    )
    stage.add_parser("serve", help="serve a stage: omni stage serve --config FILE [--port N]")
    run = stage.add_parser("run", help="start a stage, answer one prompt, stop it")
    run.add_argument("--config", required=True, type=Path, help="the stage file (YAML)")
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("prompt")
    args = parser.parse_args(argv)
    if args.command == "stage" and args.stage_command == "run":
        return asyncio.run(_run_stage(args.config, args.prompt, args.max_tokens))
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())
