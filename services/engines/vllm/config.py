"""The vllm engine's ``engine_args`` (its settings model): two keys of ours, the
rest handed to vLLM.

Our keys are ``defaults`` (what a request gets for an unset sampling parameter) and
``memory_ratio`` (the stage's share of the GPU, which becomes vLLM's
``gpu_memory_utilization`` unless that is given). Every other key is gathered into
``vllm`` and goes to ``AsyncEngineArgs`` unchanged, so vLLM itself names any key it
does not know (at load: vLLM lives in the GPU image only).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from services.engines.base import EngineSettings
from services.engines.defaults import TextDefaults
from services.engines.engine_args import EngineArgs

_OURS = ("defaults", "memory_ratio")
# Keys the stage file sets itself (model:, load_format:): two sources of truth
# would disagree silently.
_STAGE_KEYS = ("model", "load_format")


class VllmArgs(EngineArgs):
    defaults: TextDefaults = TextDefaults()
    memory_ratio: float | None = Field(None, gt=0, le=1)
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
            "dtype": settings.dtype or "auto",
            # The stage reports its own metrics; vLLM's periodic stat lines are noise here.
            "disable_log_stats": True,
        }
        if settings.load_format == "dummy":
            kwargs["load_format"] = "dummy"  # random weights of the real architecture
        if self.memory_ratio is not None:
            kwargs["gpu_memory_utilization"] = self.memory_ratio
        kwargs.update(self.vllm)
        return kwargs
