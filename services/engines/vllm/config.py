"""The vllm engine's ``engine_args`` (its settings model): our keys, the rest
handed to vLLM.

Our keys are ``defaults`` (what a request gets for an unset sampling parameter),
``memory_ratio`` (the stage's share of the GPU, which becomes vLLM's
``gpu_memory_utilization`` unless that is given) and, for vLLM's CPU build, ``cpu``
(its KV cache size and thread binding, which vLLM reads from the environment only).
Every other key is gathered into ``vllm`` and goes to ``AsyncEngineArgs`` unchanged,
so vLLM itself names any key it does not know (at load: vLLM is not in every venv).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from services.engines.base import EngineSettings
from services.engines.defaults import TextDefaults
from services.engines.engine_args import EngineArgs
from services.mesh.config_files import Frozen

_OURS = ("defaults", "memory_ratio", "cpu")
# Keys the stage file sets itself (model:, load_format:): two sources of truth
# would disagree silently.
_STAGE_KEYS = ("model", "load_format")


# A CPU list as VLLM_CPU_OMP_THREADS_BIND takes it: "0-3", "0,2,4", "0-1|2-3" (one
# list per tensor-parallel rank).
_CPU_LIST = r"\d+(-\d+)?(,\d+(-\d+)?)*(\|\d+(-\d+)?(,\d+(-\d+)?)*)*"


class CpuArgs(Frozen):
    """vLLM's CPU build, sized for a small machine by default: a 1 GiB KV cache (vLLM
    would take ~4 GiB) and every core this process may use (vLLM would keep one
    back, half of a 2-core machine)."""

    kv_cache_gib: float = Field(1.0, gt=0, le=4096)  # VLLM_CPU_KVCACHE_SPACE
    # VLLM_CPU_OMP_THREADS_BIND: "all" (this process's CPUs), "auto" (vLLM picks,
    # per NUMA node), "nobind", or a CPU list.
    threads_bind: str = Field("all", pattern=rf"^(all|auto|nobind|{_CPU_LIST})$")
    reserved_cpus: int = Field(0, ge=0, le=4096)  # VLLM_CPU_NUM_OF_RESERVED_CPU

    def environment(self) -> dict[str, str]:
        """The variables vLLM's CPU build reads when it starts its engine process."""
        bind = self.threads_bind
        if bind == "all":
            bind = cpu_list(sorted(os.sched_getaffinity(0)))
        return {
            "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus),
        }


def cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class VllmArgs(EngineArgs):
    defaults: TextDefaults = TextDefaults()
    memory_ratio: float | None = Field(None, gt=0, le=1)
    cpu: CpuArgs = CpuArgs()
    # Passed to AsyncEngineArgs as given (enforce_eager, max_model_len, ...).
    vllm: Mapping[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _gather_vllm_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or "vllm" in data:
            return data  # not ours to sort: pydantic refuses it by name
        stage_keys = [key for key in _STAGE_KEYS if key in data]
        if stage_keys:
            raise ValidationError.from_exception_data(
                cls.__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "stage_key", "set by the stage file's own {key}: key", {"key": key}
                        ),
                        loc=(key,),
                        input=data[key],
                    )
                    for key in stage_keys
                ],
            )
        ours = {key: data[key] for key in _OURS if key in data}
        return {**ours, "vllm": {k: v for k, v in data.items() if k not in ours}}

    @field_validator("vllm")
    @classmethod
    def _read_only(cls, vllm: Mapping[str, Any]) -> Mapping[str, Any]:
        return MappingProxyType(dict(vllm))

    @property
    def prompt_embeds_enabled(self) -> bool:
        return bool(self.vllm.get("enable_prompt_embeds", False))

    def async_engine_kwargs(self, settings: EngineSettings, model_path: Path) -> dict[str, Any]:
        """Keyword arguments for ``vllm.engine.arg_utils.AsyncEngineArgs``."""
        kwargs: dict[str, Any] = {
            "model": str(model_path),
            "dtype": resolved_dtype(settings),
            # The stage reports its own metrics; vLLM's periodic stat lines are noise here
            # (the engine's own stat logger still sees every step: steps.py).
            "disable_log_stats": True,
        }
        if settings.load_format == "dummy":
            kwargs["load_format"] = "dummy"  # random weights of the real architecture
        if self.memory_ratio is not None:
            kwargs["gpu_memory_utilization"] = self.memory_ratio
        kwargs.update(self.vllm)
        return kwargs


def resolved_dtype(settings: EngineSettings) -> str:
    """The stage's ``dtype`` for vLLM. ``auto`` (or none) on a CPU is float32: vLLM's
    own ``auto`` takes bfloat16 there, which changes about half of SmolLM2's greedy
    answers (one at its first token) and got a one-fact question wrong on an Intel
    CPU, for less than twice the tokens/s (benchmarks/vllm_precision.py; the figures
    are in docs/engines.md). Elsewhere vLLM decides."""
    name = settings.dtype or "auto"
    return "float32" if name == "auto" and settings.device == "cpu" else name
