"""A large image into the mesh: chunked content part vs. one message, side by side.

    python benchmarks/media_input.py [--mib 20] [--rounds 5] [--out FILE]

One stage process (services/testing/media_engine.py: it hashes what it got, so the
engine does no model work) and `omni orchestrator serve`, as their own
processes; this process is the client. Each round sends the same bytes two ways,
in alternating order:

    image part   `client.generate(prompt, media=[image])`: over 1 MiB, the client
                 sends it by GenerateStream as TensorChunks, the orchestrator
                 cuts it again for the stage (what content parts do)
    one message  the same bytes as a uint8 tensor in the one unary Generate
                 message (what a client had to do before: the message must fit
                 the orchestrator's and the stage's max_message_bytes)

Latency is request sent -> Done. No target: the chunked path should cost about
what one message costs while never needing a message as large as the media.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import OrchestratorProcess, StageProcess
from orchestrator.client import AsyncClient, content
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2

ROOT = Path(__file__).resolve().parents[1]


async def _image(client: AsyncClient, image: stage_pb2.ContentPart, expected: str) -> float:
    began = time.perf_counter()
    result = await client.generate("What is it?", media=[image]).collect()
    took = time.perf_counter() - began
    assert result.ok, result.done
    got = json.loads(result.stages["media"].text)["turns"][0]["parts"][0]["sha256"]
    assert got == expected, "the engine got other bytes"
    return took


async def _one_message(client: AsyncClient, data: bytes) -> float:
    tensor = tensor_pb2.Tensor(name="image", dtype="uint8", shape=[len(data)], raw=data)
    inputs = stage_pb2.StageInputs(tensors=[tensor])
    inputs.messages.add(role="user", content="What is it?")
    began = time.perf_counter()
    result = await client.generate(inputs=inputs).collect()
    took = time.perf_counter() - began
    assert result.ok, result.done
    return took


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mib", type=int, default=20, help="the image's size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    data = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * (args.mib << 12)
    expected = hashlib.sha256(data).hexdigest()
    image = content.image(data, "image/png")
    times: dict[str, list[float]] = {"image part": [], "one message": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        stage_file = folder / "media.yaml"
        stage_file.write_text(
            yaml.safe_dump(
                {
                    "name": "media",
                    "engine": "services.testing.media_engine:MediaEngine",
                    "load_format": "dummy",
                    "cache_dir": str(folder / "cache"),
                }
            )
        )
        with (folder / "log").open("ab") as log:
            stage = StageProcess(stage_file, env={"PYTHONPATH": str(ROOT)}, log=log)
            orchestrator = None
            try:
                address = await stage.start()
                pipeline = folder / "pipeline.yaml"
                pipeline.write_text(
                    yaml.safe_dump(
                        {"name": "bench", "stages": [{"name": "media", "address": address}]}
                    )
                )
                orchestrator = OrchestratorProcess(pipeline, log=log)
                async with AsyncClient(await orchestrator.start()) as client:
                    await client.wait_ready(timeout_s=120)
                    await _image(client, image, expected)  # warm both paths once
                    await _one_message(client, data)
                    for round_ in range(args.rounds):
                        order = ["image part", "one message"][:: 1 if round_ % 2 else -1]
                        for way in order:
                            if way == "image part":
                                times[way].append(await _image(client, image, expected))
                            else:
                                times[way].append(await _one_message(client, data))
            finally:
                if orchestrator is not None:
                    await orchestrator.stop(5)
                await stage.stop(5)
    base = median(times["one message"])
    rows = [
        {
            "way": way,
            "median ms": median(t) * 1e3,
            "min ms": min(t) * 1e3,
            "max ms": max(t) * 1e3,
            "vs one message": median(t) / base,
        }
        for way, t in times.items()
    ]
    print(f"{args.mib} MiB image, client -> orchestrator -> stage -> Done ({args.rounds} rounds)")
    print(table(rows, ["way", "median ms", "min ms", "max ms", "vs one message"]))
    path = write_json("media_input", {"mib": args.mib, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
