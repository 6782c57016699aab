"""``engine_args`` of the transformers engine (its settings model), and the torch
dtype it runs in.

The dtype is one setting, the stage file's ``dtype:`` (``auto`` or null, float32,
bfloat16, float16). ``auto`` picks the fastest precision whose greedy answers are
float32's on the fixed prompt set (services/testing/chat_prompts.py, 32 prompts x 32
greedy tokens, ``benchmarks/precision_agreement.py`` measures it): 0 of 32 may
differ. On a CPU no lower precision meets that bar (``CPU_DIFFERING``), so ``auto``
is float32 there and bfloat16 (faster, oneDNN-packed; docs/benchmarks.md) runs only
when the stage file names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from services.engines.base import EngineSettings
from services.engines.defaults import TextDefaults
from services.engines.engine_args import EngineArgs, StageFacts
from services.engines.transformers.weights.packed import bfloat16_supported
from services.mesh.errors import InitFailed

# Greedy answers (of the 32 fixed prompts, 32 tokens each) that differ from
# float32's, per CPU precision, measured with benchmarks/precision_agreement.py on
# SmolLM2-135M, the whole model in that precision (machine and the linears-only
# variant: docs/benchmarks.md). ``auto`` takes a precision only at 0.
CPU_DIFFERING: dict[str, int] = {"bfloat16": 15}
# The GGUF-block products' activations unless engine_args names them
# (TransformersArgs.activations). int8 would be the default only with at least 30 of
# the 32 greedy answers float32's; benchmarks/precision_agreement.py found far fewer
# on SmolLM2-135M (docs/benchmarks.md, 8-bit activations), so float32.
DEFAULT_ACTIVATIONS: Literal["float32", "int8"] = "float32"
# Fastest first: bfloat16 halves the bytes each token reads (memory-bound decode).
_CPU_CANDIDATES = ("bfloat16",)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class TransformersArgs(EngineArgs):
    """``engine_args`` keys this engine honours; anything else is refused."""

    defaults: TextDefaults = TextDefaults()
    # Applied to the model config before building it; only with load_format "dummy",
    # so tests and benchmarks get a tiny model that still uses the real tokenizer.
    config_overrides: Mapping[str, Any] = Field(default_factory=dict)
    # Prompt tokens one prefill forward may run, all newcomers together: bigger
    # prefills faster, smaller stalls the running decoders less.
    prefill_tokens: int = Field(512, ge=1)
    # How long at most an idle engine waits after a request arrives for others the
    # stage has checked with it (on their way: Scheduler.expect) or that keep
    # arriving, so that they share their first step; a lone request waits ~4 ms.
    gather_ms: float = Field(10.0, ge=0, allow_inf_nan=False)
    # How the linear weights are held (CPU):
    #   gguf_blocks: the GGUF file's own Q4_1 / Q8_0 blocks, float32 activations
    #     (weights/blocks.py, on services/kernels): about a sixth of float32's bytes per
    #     token; layers whose weight is in no such block stay packed. Needs a .gguf
    #     model, dtype float32 and the CPU kernels.
    #   packed: float32 or bfloat16 packed once for oneDNN (weights/packed.py), so a
    #     batched step costs far less than one step per request.
    #   plain: as loaded (torch's default linear).
    #   auto: gguf_blocks where it applies and the kernels have a vector variant for
    #     this CPU (AVX2 or AVX-512), else packed.
    weights: Literal["auto", "gguf_blocks", "packed", "plain"] = "auto"
    # The activations the GGUF-block products multiply (weights on gguf_blocks only):
    #   float32: as they are; every weight dequantised to float32 (float32's answers up
    #     to the order of the additions).
    #   int8: rounded to 8 bits per 32 values as llama.cpp's Q8_1 does, multiplied with
    #     integer dot products (about half the instructions a weight block), in every
    #     product, prefills included.
    activations: Literal["float32", "int8"] = DEFAULT_ACTIVATIONS
    # Which model runner (runners/) runs the model: auto, the fastest that takes it
    # (llama_cpu for a Llama-shaped GGUF on its blocks); reference, transformers' own
    # forward for any model.
    runner: Literal["auto", "reference"] = "auto"

    @model_validator(mode="after")
    def _int8_needs_blocks(self) -> TransformersArgs:
        if self.activations == "int8" and self.weights in ("packed", "plain"):
            raise ValueError(
                f"activations: int8 runs on GGUF blocks only, not with weights: {self.weights}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _dtype_is_the_stage_files(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping) and "dtype" in raw:
            raise ValueError("dtype is set by the stage file's own dtype:, not in engine_args")
        return raw

    @field_validator("config_overrides")
    @classmethod
    def _dummy_only(cls, overrides: Mapping[str, Any], info: ValidationInfo) -> Any:
        if overrides and StageFacts.of(info).load_format != "dummy":
            # Overriding the shape of a real checkpoint could only fail at load time.
            raise ValueError("needs load_format: dummy")
        return MappingProxyType(dict(overrides))

    def torch_dtype(self, settings: EngineSettings) -> torch.dtype:
        """The stage's ``dtype``; ``auto`` (or none) resolved for this device."""
        name = settings.dtype or "auto"
        if name == "auto":
            name = auto_dtype(settings.device, bfloat16_supported())
        if name not in _DTYPES:
            allowed = ["auto", *sorted(_DTYPES)]
            raise InitFailed(f"dtype: {name!r} is not one of {allowed}", field="dtype")
        return _DTYPES[name]


def auto_dtype(
    device: str, cpu_bfloat16: bool, differing: Mapping[str, int] = CPU_DIFFERING
) -> str:
    """What ``dtype: auto`` runs in. On a CPU: the fastest precision this CPU runs
    natively (``cpu_bfloat16``: oneDNN has bfloat16 kernels for it) whose greedy
    answers matched float32's on every prompt (``differing``), else float32. GPUs
    all have bfloat16 now."""
    if device != "cpu":
        return "bfloat16"
    native = {"bfloat16": cpu_bfloat16}
    for name in _CPU_CANDIDATES:
        if native[name] and differing.get(name, 1) == 0:
            return name
    return "float32"
