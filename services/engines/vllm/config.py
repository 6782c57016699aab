"""The vllm engine's ``engine_args``: two keys of ours, the rest handed to vLLM.

Our keys are ``defaults`` (what a request gets for an unset sampling parameter) and
``memory_ratio`` (the stage's share of the GPU, which becomes vLLM's
``gpu_memory_utilization`` unless that is given). Every other key goes to
``AsyncEngineArgs`` unchanged, so vLLM itself names any key it does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from services.engines.base import EngineSettings
from services.engines.text_defaults import SamplingDefaults
from services.mesh.errors import InitFailed

OWN_KEYS = frozenset({"defaults", "memory_ratio"})


@dataclass(frozen=True)
class VllmArgs:
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    memory_ratio: float | None = None
    # Passed to AsyncEngineArgs as given (enforce_eager, max_model_len, ...).
    vllm: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> VllmArgs:
        args = dict(settings.engine_args)
        try:
            defaults = SamplingDefaults.parse(args.pop("defaults", None))
        except ValueError as exc:
            raise InitFailed(str(exc), field="engine_args.defaults") from None
        memory_ratio = args.pop("memory_ratio", None)
        if memory_ratio is not None and not (
            isinstance(memory_ratio, int | float) and 0 < memory_ratio <= 1
        ):
            raise InitFailed(
                f"engine_args.memory_ratio must be in (0, 1], got {memory_ratio!r}",
                field="engine_args.memory_ratio",
            )
        for ours in ("model", "load_format"):
            if ours in args:
                # The stage decides these (model source, load_format); two sources of
                # truth would disagree silently.
                raise InitFailed(
                    f"engine_args.{ours} is set by the stage, not engine_args",
                    field=f"engine_args.{ours}",
                )
        return cls(
            defaults=defaults,
            memory_ratio=None if memory_ratio is None else float(memory_ratio),
            vllm=MappingProxyType(args),
        )

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
