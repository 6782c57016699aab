"""``engine_args`` of the transformers engine (its settings model), and the torch
dtype it runs in."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from services.engines.base import EngineSettings
from services.engines.defaults import TextDefaults
from services.engines.engine_args import EngineArgs, StageFacts
from services.mesh.errors import InitFailed

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class TransformersArgs(EngineArgs):
    """``engine_args`` keys this engine honours; anything else is refused."""

    # The stage file's own `dtype:` wins over this one (torch_dtype).
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    defaults: TextDefaults = TextDefaults()
    # Applied to the model config before building it; only with load_format "dummy",
    # so tests and benchmarks get a tiny model that still uses the real tokenizer.
    config_overrides: Mapping[str, Any] = Field(default_factory=dict)
    # Prompt tokens one prefill forward may run, all newcomers together: bigger
    # prefills faster, smaller stalls the running decoders less.
    prefill_tokens: int = Field(512, ge=1)
    # How long an idle engine waits after a request arrives for others sent with
    # it, so that they share their first step (costs a lone request this much TTFT).
    gather_ms: float = Field(10.0, ge=0, allow_inf_nan=False)
    # Pack the linear weights for oneDNN once at load (CPU, float32 only): batched
    # decode steps then cost far less than one step per request (packed_linear.py).
    packed_weights: bool = True

    @field_validator("config_overrides")
    @classmethod
    def _dummy_only(cls, overrides: Mapping[str, Any], info: ValidationInfo) -> Any:
        if overrides and StageFacts.of(info).load_format != "dummy":
            # Overriding the shape of a real checkpoint could only fail at load time.
            raise ValueError("needs load_format: dummy")
        return MappingProxyType(dict(overrides))

    def torch_dtype(self, settings: EngineSettings) -> torch.dtype:
        """The stage's ``dtype``, else ours, else the device's default."""
        name = settings.dtype or self.dtype or _default_dtype(settings.device)
        if name not in _DTYPES:
            raise InitFailed(f"dtype: {name!r} is not one of {sorted(_DTYPES)}", field="dtype")
        return _DTYPES[name]


def _default_dtype(device: str) -> str:
    # CPUs lack fast half-precision matmuls; GPUs all have bf16 now.
    return "float32" if device == "cpu" else "bfloat16"
