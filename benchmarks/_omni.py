"""Shared by the Qwen3-Omni benchmarks (omni_gpu.py, first_audio.py): the three
stages' configs, the pipeline's edges, the prompt, and code2wav in this process.

One place builds them so the GPU script and the tiny case time the same
pipeline. On the tiny random checkpoint the talker's answer length depends on
the prompt: "Tell me a short story about the sea." ends (codec_eos) after 22
codes, 2 s of speech at the real model's 12.5 codes/s, too short to show what
a windowed edge buys; on PROMPT it runs past 400 codes without ending, so the
talker's ``max_tokens`` sets the answer's length exactly (TALKER_TOKENS = 128
codes, about 10 s of speech for the real model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PROMPT = "Write a short story about a lighthouse keeper and a storm at sea."
THINKER_TOKENS = 32  # the tiny thinker's answer (the real one: omni_gpu --tokens)
TALKER_TOKENS = 128  # codes: >= 100, as a real spoken answer (10 s at 12.5 codes/s)
TINY_CHUNK = 12  # code2wav's chunk_size (= the window) in examples/pipelines/qwen3-omni.yaml
LEFT_CONTEXT = 25
SAMPLE_RATE = 24000
CODES_PER_S = 12.5  # the real Qwen3-Omni codec: 80 ms of speech per code


def stage_configs(
    model: str | None,
    devices: list[str],
    *,
    tokens: int,
    talker_tokens: int,
    chunk: int,
    tiny: bool,
    cache_dir: str | None = None,
) -> dict[str, dict[str, Any]]:
    """thinker, talker and code2wav stage configs, by name: greedy, seeded, on
    ``devices`` (thinker, talker, code2wav); ``model`` None serves the tiny
    checkpoint (load_format dummy, one torch thread each as the example does)."""
    source: dict[str, Any] = {"load_format": "dummy"} if model is None else {"model": model}
    if cache_dir is not None:
        source["cache_dir"] = cache_dir
    dtype = {} if tiny else {"dtype": "bfloat16"}
    threads = {"torch_threads": 1} if tiny else {}
    configs: dict[str, dict[str, Any]] = {
        "thinker": {"engine": "qwen_omni_thinker", **dtype,
                    "defaults": {"temperature": 0.0, "max_tokens": tokens}},
        "talker": {"engine": "qwen_omni_talker", **dtype,
                   "defaults": {"temperature": 0.0, "max_tokens": talker_tokens, "seed": 0}},
        "code2wav": {"engine": "qwen_omni_code2wav",
                     "engine_args": {"chunk_size": chunk, "left_context_size": LEFT_CONTEXT},
                     "runtime": {"streaming_input": True}},
    }  # fmt: skip
    out = {}
    for (name, config), device in zip(configs.items(), devices, strict=True):
        config = {"name": name, **source, **config}
        config["runtime"] = {**dict(config.get("runtime", {})), "device": device, **threads}
        out[name] = config
    return out


def edges(window: int) -> list[dict[str, Any]]:
    """thinker → talker streamed as the example pipelines do (the prompt's part and
    the first token, then two tokens a window), talker → code2wav ``window`` (-1,
    or code2wav's chunk_size)."""
    return [
        {"from": "thinker", "to": "talker", "first_window": 2, "window": 2},
        {"from": "talker", "to": "code2wav", "window": window},
    ]


class Code2Wav:
    """code2wav of ``folder`` in this process: ``chunked_decode`` as the stage
    decodes, for timing the stage against the model it serves."""

    def __init__(self, folder: Path, chunk: int, device: str = "cpu") -> None:
        from services.engines.qwen_omni import loading

        self.chunk = chunk
        self.model, _ = loading.load_part(folder, "code2wav", torch.float32, device)

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """Audio samples [n] of ``codes`` [steps, groups]."""
        with torch.no_grad():
            wav = self.model.chunked_decode(codes.T[None], self.chunk, LEFT_CONTEXT)
        return wav.reshape(-1)
