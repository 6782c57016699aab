"""`omni orchestrator serve` and `omni generate` as a user runs them, probed with grpcurl."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from PIL import Image

from orchestrator.client import AsyncClient
from tests.helpers.grpcurl import GRPCURL, json_stream

OMNI = str(Path(sys.executable).parent / "omni")


async def test_serve_generate_and_probe(stages, tmp_path: Path) -> None:
    pipeline = tmp_path / "pipe.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "name": "cli",
                "stages": [
                    {"name": n, "address": stages.addresses[n]} for n in ("thinker", "renderer")
                ],
                "edges": [
                    {
                        "from": "thinker",
                        "to": "renderer",
                        "transform": "hidden_states_to_prompt_embeds",
                    }
                ],
                "outputs": ["thinker", "renderer"],
            }
        )
    )
    proc = await asyncio.create_subprocess_exec(
        OMNI,
        "orchestrator",
        "serve",
        "--pipeline",
        str(pipeline),
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        address = line.removeprefix("listening ")
        async with AsyncClient(address) as client:
            await client.wait_ready(timeout_s=60)
        listed = await asyncio.to_thread(
            subprocess.run, [GRPCURL, "-plaintext", address, "list"], capture_output=True, text=True
        )
        assert "omni.v1.Orchestrator" in listed.stdout.split()
        health = await asyncio.to_thread(
            subprocess.run,
            [
                GRPCURL,
                "-plaintext",
                "-d",
                '{"service": "omni.v1.Orchestrator"}',
                address,
                "grpc.health.v1.Health/Check",
            ],
            capture_output=True,
            text=True,
        )
        assert json.loads(health.stdout)["status"] == "SERVING"
        watched = await asyncio.to_thread(
            subprocess.run,
            [GRPCURL, "-plaintext", "-max-time", "2", address, "omni.v1.Orchestrator/WatchStages"],
            capture_output=True,
            text=True,
        )
        states = {s["name"]: s["state"] for s in json_stream(watched.stdout)}
        assert states == {"thinker": "STAGE_READY", "renderer": "STAGE_READY"}
        stages_listed = await asyncio.to_thread(
            subprocess.run,
            [GRPCURL, "-plaintext", address, "omni.v1.Orchestrator/ListStages"],
            capture_output=True,
            text=True,
        )
        thinker = {s["name"]: s for s in json.loads(stages_listed.stdout)["stages"]}["thinker"]
        # What its engine runs on, from its Describe (a tiny random Llama: float32).
        assert thinker["compute"].startswith("reference runner, "), thinker
        out = tmp_path / "out"
        done = await asyncio.to_thread(
            subprocess.run,
            [
                OMNI,
                "generate",
                "Draw a cat.",
                "--address",
                address,
                "--out",
                str(out),
                "--max-tokens",
                "5",
                "--request-id",
                "cat",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "[thinker]" in done.stderr
        image = Image.open(out / "cat-renderer-image.png")
        assert image.size[0] > 0 and image.mode == "RGB"
        # The edge asked the thinker for hidden states; the client did not get them.
        assert not (out / "cat-thinker.safetensors").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


def test_a_bad_pipeline_file_exits_two_naming_file_and_path(tmp_path: Path) -> None:
    pipeline = tmp_path / "bad.yaml"
    pipeline.write_text(
        "name: bad\nstages:\n  - {name: a, address: '127.0.0.1:1'}\nedges:\n  - {from: a, to: b}\n"
    )
    done = subprocess.run(
        [OMNI, "orchestrator", "serve", "--pipeline", str(pipeline), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"{pipeline}: edges.0.to: unknown stage" in done.stderr
