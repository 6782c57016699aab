"""`omni up` as a user runs it: the default pipeline comes up, answers, survives a
crashed stage, and leaves no process or shared-memory block behind."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import wave
from pathlib import Path

import numpy as np
import psutil
import yaml
from hibari import Hibari

from orchestrator.client import AsyncClient, Result
from services.mesh import wav
from services.mesh.pb.omni.v1 import orchestrator_pb2
from tests.engines.whisper.wer import wer
from tests.helpers.reference_answer import ReferenceLM
from tests.helpers.shm_blocks import blocks_of

REPO = Path(__file__).resolve().parents[3]
OMNI = str(Path(sys.executable).parent / "omni")


async def read_until(
    stream: asyncio.StreamReader, prefix: str, timeout_s: float, seen: list[str] | None = None
) -> str:
    """The first line starting with ``prefix``; the lines read go to ``seen``."""

    async def scan() -> str:
        while line := (await stream.readline()).decode():
            if seen is not None:
                seen.append(line)
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"omni up ended before printing {prefix!r}")

    return await asyncio.wait_for(scan(), timeout_s)


async def omni_generate(address: str, out: Path, *args: str) -> tuple[str, str]:
    """`omni generate ARGS --max-tokens 8`: its stdout (the answer) and stderr."""
    run = await asyncio.create_subprocess_exec(
        OMNI, "generate", *args, "--address", address, "--max-tokens", "8", "--out", str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(run.communicate(), 180)
    assert run.returncode == 0, err.decode()
    return out.decode(), err.decode()


def shm_blocks(mesh_id: str) -> list[str]:
    return blocks_of(mesh_id)


async def test_up_generates_recovers_from_a_crash_and_cleans_up(
    tmp_path: Path, omni_cache_dir: Path, smollm2_reference: ReferenceLM
) -> None:
    up = await asyncio.create_subprocess_exec(
        OMNI,
        "up",
        str(REPO / "examples/pipelines/default.yaml"),
        "--port",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "OMNI_CACHE_DIR": str(omni_cache_dir)},
    )
    children: list[psutil.Process] = []
    try:
        ready = await read_until(up.stdout, "ready in", 240)
        address = ready.rsplit(" ", 1)[1]
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 4  # one process per stage; the orchestrator is omni up itself

        out = tmp_path / "out"
        generate = await asyncio.create_subprocess_exec(
            OMNI,
            "generate",
            "What is the capital of France?",
            "--address",
            address,
            "--out",
            str(out),
            "--request-id",
            "paris",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(generate.communicate(), 180)
        assert generate.returncode == 0, stderr.decode()
        # What the thinker says on this machine (its stage file's max_tokens).
        thinker_file = yaml.safe_load((REPO / "examples/pipelines/stages/thinker.yaml").read_text())
        said = smollm2_reference.answer(
            "What is the capital of France?", thinker_file["defaults"]["max_tokens"]
        )
        said.assert_text(stdout.decode())
        image = out / "paris-renderer-image.png"
        assert image.stat().st_size > 0
        # The answer spoken: 16-bit 24 kHz speech, as long as hibari makes the text
        # (its voice speaks 10-25 characters a second; the text is what the thinker said).
        with wave.open(str(out / "paris-speaker.wav")) as spoken:
            seconds = spoken.getnframes() / spoken.getframerate()
            pcm = np.frombuffer(spoken.readframes(spoken.getnframes()), dtype="<i2")
        answer = stdout.decode().strip()  # the thinker's text (labels go to stderr)
        assert spoken.getframerate() == 24000 and np.abs(pcm).max() > 3000
        assert len(answer) / 25 <= seconds <= len(answer) / 10, (seconds, answer)

        # A spoken question (our speaker's speech): the recogniser hears it, and
        # the thinker answers it as it answers the words typed.
        question = "What is the capital of France?"
        pcm = wav.pcm16(Hibari()(question, seed=0))
        (tmp_path / "q.wav").write_bytes(wav.header(24000, 1, len(pcm)) + pcm)
        spoken = await omni_generate(
            address, tmp_path / "heard", "--audio", str(tmp_path / "q.wav")
        )
        heard = next(
            line.removeprefix("[recogniser] ")
            for line in spoken[1].splitlines()
            if line.startswith("[recogniser] ")
        )
        assert wer(question, heard) <= 0.2, heard
        # Typed, asking for the text and the speech only: the renderer does not run.
        wanted = ("--output", "thinker", "--output", "speaker")
        typed = await omni_generate(address, tmp_path / "typed", heard, *wanted)
        assert spoken[0] == typed[0] and spoken[0].strip()
        saved = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "typed").iterdir())
        assert saved == ["speaker.wav"], saved

        # A stage that crashes fails its in-flight request at once, naming it,
        # and comes back (restarted by omni up on the same port).
        thinker = next(p for p in children if "thinker" in " ".join(p.cmdline()))
        async with AsyncClient(address) as client:
            stream = client.generate(
                "Write a long essay about rivers.", params={"max_tokens": 2000}
            )
            result = Result()
            events = stream.__aiter__()
            while "thinker" not in result.stages:
                result.add(await events.__anext__())
            thinker.kill()
            async for event in events:
                result.add(event)
            assert result.done.code_name == "UNAVAILABLE" and result.done.stage == "thinker"
            for _ in range(100):  # the monitor notices within a health poll
                states = {s.name: s.state for s in await client.list_stages()}
                if states["thinker"] != orchestrator_pb2.STAGE_READY:
                    break
                await asyncio.sleep(0.1)
            await client.wait_ready(timeout_s=120)
            again = await client.generate("Hi", params={"max_tokens": 4}).collect()
            assert again.ok, again.done
        children = [*psutil.Process(up.pid).children(recursive=True), thinker]
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(up.wait(), 60)
    assert code == 0
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    assert shm_blocks(f"up{up.pid}") == []
