"""Engine arguments of the transformers engine, parsed and validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from services.engines.base import EngineSettings
from services.engines.text_defaults import SamplingDefaults

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class TransformersArgs:
    """``engine_args`` keys this engine honours; anything else is refused."""

    dtype: torch.dtype
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Applied to the model config before building it; only with load_format "dummy",
    # so tests and benchmarks get a tiny model that still uses the real tokenizer.
    config_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Prompt tokens one prefill forward may run, all newcomers together: bigger
    # prefills faster, smaller stalls the running decoders less.
    prefill_tokens: int = 512
    # How long an idle engine waits after a request arrives for others sent with
    # it, so that they share their first step (costs a lone request this much TTFT).
    gather_ms: float = 10.0
    # Pack the linear weights for oneDNN once at load (CPU, float32 only): batched
    # decode steps then cost far less than one step per request (packed_linear.py).
    packed_weights: bool = True

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> TransformersArgs:
        args = dict(settings.engine_args)
        known = {
            "dtype",
            "defaults",
            "config_overrides",
            "prefill_tokens",
            "gather_ms",
            "packed_weights",
        }
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"engine_args: unknown keys {unknown} for the transformers engine")
        dtype_name = settings.dtype or args.get("dtype") or _default_dtype(settings.device)
        if dtype_name not in _DTYPES:
            raise ValueError(f"dtype: {dtype_name!r} is not one of {sorted(_DTYPES)}")
        defaults = SamplingDefaults.parse(args.get("defaults"))
        overrides = args.get("config_overrides") or {}
        if not isinstance(overrides, Mapping):
            raise ValueError("engine_args.config_overrides: expected a mapping")
        if overrides and settings.load_format != "dummy":
            # Overriding the shape of a real checkpoint could only fail at load time.
            raise ValueError("engine_args.config_overrides needs load_format: dummy")
        prefill_tokens = args.get("prefill_tokens", 512)
        if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int):
            raise ValueError("engine_args.prefill_tokens: expected an integer >= 1")
        if prefill_tokens < 1:
            raise ValueError("engine_args.prefill_tokens: expected an integer >= 1")
        gather_ms = args.get("gather_ms", 10.0)
        if isinstance(gather_ms, bool) or not isinstance(gather_ms, int | float) or gather_ms < 0:
            raise ValueError("engine_args.gather_ms: expected a number >= 0")
        packed_weights = args.get("packed_weights", True)
        if not isinstance(packed_weights, bool):
            raise ValueError("engine_args.packed_weights: expected true or false")
        return cls(
            packed_weights=packed_weights,
            prefill_tokens=prefill_tokens,
            gather_ms=float(gather_ms),
            dtype=_DTYPES[dtype_name],
            defaults=defaults,
            config_overrides=MappingProxyType(dict(overrides)),
        )


def _default_dtype(device: str) -> str:
    # CPUs lack fast half-precision matmuls; GPUs all have bf16 now.
    return "float32" if device == "cpu" else "bfloat16"
