"""The mesh the soak runs against: `omni up` with client tokens on (and so the mesh
token), over a pipeline shaped as the default one (thinker -> renderer and
speaker) but light enough for a 2-core machine: a tiny dummy-weight thinker
(SmolLM2's tokenizer on a random 2-layer Llama), a small dummy diffusion renderer
and the hibari speaker; each stage its own process, killed by name."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import yaml

from services.testing.configs import SMOLLM2, TINY_LLAMA

OMNI = str(Path(sys.executable).parent / "omni")
STAGES = ("thinker", "renderer", "speaker")
MB = 1_000_000


def stage_files(folder: Path, cache_dir: Path) -> dict[str, dict[str, Any]]:
    thinker = {
        "name": "thinker",
        "engine": "transformers",
        "model": SMOLLM2,
        "load_format": "dummy",
        "engine_args": {"config_overrides": TINY_LLAMA},
        "cache_dir": str(cache_dir),
        "defaults": {"temperature": 0.0, "max_tokens": 16},
        "runtime": {"torch_threads": 1, "max_batch_size": 8, "max_queue_size": 64},
    }
    renderer = {
        "name": "renderer",
        "engine": "diffusers",
        "load_format": "dummy",
        # The thinker's hidden states condition it: its width is theirs.
        "engine_args": {
            "cross_attention_dim": TINY_LLAMA["hidden_size"],
            "num_inference_steps": 2,
            "sample_size": 16,
        },
        "cache_dir": str(cache_dir),
        "runtime": {"torch_threads": 1, "max_batch_size": 4},
    }
    speaker = {
        "name": "speaker",
        "engine": "speech",
        "model": SMOLLM2,  # read for its tokenizer only
        "engine_args": {"voices": ["heart"]},
        "cache_dir": str(cache_dir),
        "defaults": {"seed": 0},
        "runtime": {"torch_threads": 1, "streaming_input": True},
    }
    return {"thinker": thinker, "renderer": renderer, "speaker": speaker}


def pipeline(folder: Path, cache_dir: Path) -> dict[str, Any]:
    stages = []
    for name, config in stage_files(folder, cache_dir).items():
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        stages.append({"name": name, "launch": str(path)})
    return {
        "name": "soak",
        "stages": stages,
        "edges": [
            {
                "from": "thinker",
                "to": "renderer",
                "window": -1,
                "transform": "hidden_states_to_prompt_embeds",
            },
            {
                "from": "thinker",
                "to": "speaker",
                "window": 4,
                "first_window": 2,
                "transform": "tokens",
            },
        ],
        "outputs": ["thinker", "renderer", "speaker"],
    }


class Mesh:
    """`omni up` over the soak's pipeline in ``folder``: started, watched, stopped."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tokens = {name: secrets.token_hex(20) for name in ("alice", "bob")}
        self.address = ""
        self.up: asyncio.subprocess.Process | None = None

    async def start(self, cache_dir: Path) -> None:
        entries = [{"name": n, "token": t} for n, t in self.tokens.items()]
        (self.folder / "tokens.yaml").write_text(yaml.safe_dump({"tokens": entries}))
        spec = pipeline(self.folder, cache_dir)
        (self.folder / "pipeline.yaml").write_text(yaml.safe_dump(spec))
        self.up = await asyncio.create_subprocess_exec(
            OMNI, "up", str(self.folder / "pipeline.yaml"), "--port", "0",
            "--run-dir", str(self.folder / "run"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "OMNI_TOKENS_FILE": str(self.folder / "tokens.yaml")},
        )  # fmt: skip
        assert self.up.stdout is not None
        while line := (await asyncio.wait_for(self.up.stdout.readline(), 300)).decode():
            if line.startswith("ready in"):
                self.address = line.split()[-1]
                return
        raise RuntimeError("omni up ended before it was ready")

    async def stop(self) -> None:
        if self.up is not None and self.up.returncode is None:
            self.up.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.up.wait(), 60)

    @property
    def orchestrator(self) -> psutil.Process:
        assert self.up is not None
        return psutil.Process(self.up.pid)

    def stage(self, name: str) -> psutil.Process | None:
        """The stage's process now (None between its death and its restart)."""
        for child in self.orchestrator.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if f"{name}.yaml" in " ".join(child.cmdline()):
                    return child
        return None

    def kill(self, name: str) -> None:
        process = self.stage(name)
        if process is not None:
            with contextlib.suppress(psutil.Error):
                process.kill()

    def memory(self) -> dict[str, float | None]:
        """RSS in MB: the orchestrator (omni up itself) and each stage."""
        sizes: dict[str, float | None] = {"orch": self.orchestrator.memory_info().rss / MB}
        for name in STAGES:
            process = self.stage(name)
            try:
                sizes[name] = process.memory_info().rss / MB if process else None
            except psutil.Error:
                sizes[name] = None
        return sizes
