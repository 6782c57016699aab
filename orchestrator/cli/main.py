"""``omni``: a thin dispatcher.

omni stage serve --config STAGE.yaml [--port N]        run one stage service
omni stage run --config STAGE.yaml "PROMPT"            start a stage, ask it, stop it
omni orchestrator serve --pipeline PIPE.yaml [--port]  run the orchestrator
omni generate ["PROMPT"] [--audio F] [--address A]     ask a running mesh
omni gateway [--orchestrator A] [--port 8000]          an OpenAI-compatible HTTP API
omni up [PIPE.yaml] [--http PORT]                      everything on this machine

TLS and tokens (off unless given): `omni orchestrator serve --tls-cert ...`,
`omni up --tls` (a throwaway mesh CA), `omni generate --cacert CA --token T`.
Every flag has an OMNI_* environment variable (see services/mesh/environment.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from orchestrator.client import DEFAULT_ADDRESS
from services.mesh import environment
from services.mesh.data.malloc import keep_freed_memory
from services.mesh.process import port_number


def _security_flags(parser: argparse.ArgumentParser) -> None:
    """The orchestrator's TLS and token files (each overrides its OMNI_* variable)."""
    group = parser.add_argument_group("TLS and tokens (default: off, or OMNI_* env)")
    group.add_argument("--tls-cert", type=Path, help="this server's certificate (PEM)")
    group.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    group.add_argument("--tls-ca", type=Path, help="the mesh CA: verifies the stages")
    group.add_argument("--client-cert", type=Path, help="presented to the stages (mTLS)")
    group.add_argument("--client-key", type=Path, help="its private key")
    group.add_argument("--mesh-token-file", type=Path, help="the mesh token, sent to stages")
    group.add_argument("--tokens-file", type=Path, help="client bearer tokens (YAML)")
    group.add_argument("--max-pause-s", type=float, help="longest PauseGeneration holds requests")


def _media_flags(parser: argparse.ArgumentParser) -> None:
    kinds = "PNG, JPEG, WebP, GIF or BMP", "WAV, MP3, FLAC or Ogg"
    for flag, kind in zip(("--image", "--audio"), kinds, strict=True):
        parser.add_argument(
            flag,
            type=Path,
            action="append",
            default=[],
            metavar="FILE",
            help=f"send this {kind} file with the prompt (repeatable; in order, before the text)",
        )


def _parser() -> argparse.ArgumentParser:
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
    orch = commands.add_parser("orchestrator", help="the orchestrator service").add_subparsers(
        dest="orchestrator_command", required=True
    )
    serve = orch.add_parser("serve", help="route requests through a pipeline's stages")
    serve.add_argument("--pipeline", required=True, type=Path, help="the pipeline file (YAML)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=50050, help="0 picks a free port")
    serve.add_argument(
        "--health-port",
        type=port_number,
        help="also serve grpc.health.v1 alone, plaintext, on this port (probes under TLS)",
    )
    serve.add_argument(
        "--peers",
        default="",
        metavar="TARGET",
        help="the other orchestrators over the same stages (ipv4:a:p,b:p or dns:NAME:PORT, "
        "looked up again at each use): Abort, PauseGeneration and ResumeGeneration reach "
        "them too (default: none)",
    )
    _security_flags(serve)
    up = commands.add_parser("up", help="start every stage and the orchestrator on this machine")
    up.add_argument(
        "pipeline", nargs="?", type=Path, help="default: examples/pipelines/default.yaml"
    )
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument(
        "--port", type=port_number, default=50050, help="the orchestrator's; 0 picks one"
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="make a throwaway mesh CA: mTLS and a mesh token between orchestrator and "
        "stages, TLS at the front door with the tokens of OMNI_TOKENS_FILE and an admin "
        "token (files in RUN_DIR/pki, removed at stop). A tokens file alone turns on the "
        "mesh token and client tokens without TLS",
    )
    up.add_argument("--run-dir", type=Path, help="where stage logs go (default: a temp dir)")
    once_or_served = up.add_mutually_exclusive_group()
    once_or_served.add_argument(
        "--prompt", help="answer this prompt once ready, then stop everything"
    )
    once_or_served.add_argument(
        "--http",
        type=port_number,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API (omni gateway) on this port, "
        "until Ctrl-C; 0 picks one",
    )
    up.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        help="with --http: the gateway's realtime sessions at once (omni gateway --max-sessions)",
    )
    up.add_argument("--out", type=Path, default=Path("omni-out"), help="where outputs go")
    up.add_argument("--max-tokens", type=int, help="for the entry stage")
    _media_flags(up)
    commands.add_parser(
        "gateway",
        help="an OpenAI-compatible HTTP API in front of an orchestrator (omni gateway --help)",
        add_help=False,
    )
    gen = commands.add_parser("generate", help="send a prompt to a running mesh")
    gen.add_argument("prompt", nargs="?", help="the text (optional with --audio or --image)")
    address = environment.ADDRESS.get()
    gen.add_argument(
        "--address",
        default=DEFAULT_ADDRESS if address is None else address,
        help="the orchestrator's, or several (IP:PORT,IP:PORT or dns:NAME:PORT)",
    )
    gen.add_argument("--out", type=Path, default=Path("omni-out"), help="where outputs go")
    gen.add_argument("--max-tokens", type=int, help="for the entry stage")
    _media_flags(gen)
    gen.add_argument("--seed", type=int, help="for every stage")
    gen.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="STAGE",
        help="only this output stage's answer (repeatable): the stages no output asked "
        "for do not run (default: every output)",
    )
    gen.add_argument("--request-id", default="")
    gen.add_argument("--timeout", type=float, help="seconds; the deadline reaches the stages")
    gen.add_argument(
        "--token",
        default=environment.TOKEN.get(),
        help="bearer token (default: $OMNI_TOKEN, or the file $OMNI_TOKEN_FILE)",
    )
    gen.add_argument(
        "--cacert",
        type=Path,
        default=environment.CACERT.get(),
        help="speak TLS, verifying the orchestrator with this CA (default: $OMNI_CACERT)",
    )
    gen.add_argument("--tls", action="store_true", help="speak TLS, verified by system roots")
    return parser


def _gateway_args(args: argparse.Namespace) -> list[str]:
    """``omni up``'s flags for its gateway, as ``omni gateway`` takes them."""
    return [] if args.max_sessions is None else ["--max-sessions", str(args.max_sessions)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["stage", "serve"]:
        # The stage service's own entry point: the orchestrator never imports it.
        os.execv(sys.executable, [sys.executable, "-m", "services.stage", *argv[1:]])
    if argv[:1] == ["gateway"]:
        # Its own process, its own flags: the omni command never imports the web stack.
        os.execv(sys.executable, [sys.executable, "-m", "services.gateway", *argv[1:]])
    args = _parser().parse_args(argv)
    if args.command in ("orchestrator", "up"):
        # Relayed tensor chunks (1 MiB) reuse warm buffers; at most 16 MiB freed is
        # kept atop each heap, so a burst of large client messages does not stay
        # resident in gRPC's thread arenas (malloc_trim cannot reach their tops).
        keep_freed_memory(trim_threshold=16 << 20)
    if args.command == "stage":
        from orchestrator.cli.commands import run_stage

        return asyncio.run(run_stage(args.config, args.prompt, args.max_tokens))
    if args.command == "orchestrator":
        from orchestrator.cli.commands import serve_orchestrator

        flags = {
            key: getattr(args, key)
            for key in (
                "tls_cert",
                "tls_key",
                "tls_ca",
                "client_cert",
                "client_key",
                "mesh_token_file",
                "tokens_file",
                "max_pause_s",
            )
        }
        return serve_orchestrator(
            args.pipeline, args.host, args.port, flags, args.health_port, peers=args.peers
        )
    media = []
    if args.command in ("up", "generate"):
        from orchestrator.client.content import MediaFileError, files

        if args.command == "up" and (args.image or args.audio) and args.prompt is None:
            print("omni up: --image and --audio go with --prompt", file=sys.stderr)
            return 2
        if args.command == "generate" and args.prompt is None and not (args.image or args.audio):
            print("omni generate: give a prompt, --audio or --image", file=sys.stderr)
            return 2
        try:  # before anything starts: a wrong path is told at once
            media = files(args.image, args.audio)
        except MediaFileError as exc:
            print(f"omni {args.command}: {exc}", file=sys.stderr)
            return 2
    if args.command == "up":
        from orchestrator.cli.commands import default_pipeline
        from orchestrator.cli.up import up

        return asyncio.run(
            up(
                args.pipeline or default_pipeline(),
                host=args.host,
                port=args.port,
                run_dir=args.run_dir,
                prompt=args.prompt,
                out=args.out,
                max_tokens=args.max_tokens,
                tls=args.tls,
                http=args.http,
                media=media,
                gateway_args=_gateway_args(args),
            )
        )
    from orchestrator.cli.commands import generate
    from services.mesh.security import client_dialing, read_secret

    token = args.token
    token_file = environment.TOKEN_FILE.get()
    if not token and token_file is not None:
        token = read_secret(token_file)
    dialing = client_dialing(token=token, ca=args.cacert, tls=args.tls)

    return asyncio.run(
        generate(
            args.address,
            args.prompt,
            args.out,
            request_id=args.request_id,
            max_tokens=args.max_tokens,
            seed=args.seed,
            dialing=dialing,
            timeout_s=args.timeout,
            media=media,
            outputs=args.output,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
