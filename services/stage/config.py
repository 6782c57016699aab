"""The stage file (YAML), validated once into frozen models (errors: see
services.mesh.config_files)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.engines.base import EngineSettings, SamplingParams
from services.engines.registry import ENGINES, is_plugin
from services.mesh import config_files, environment
from services.mesh.data.chunks import CHUNK_BYTES
from services.mesh.security import SecuritySettings

_NUMBERS = (int, float, int | None, float | None)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML's true/false would otherwise pass as 1/0 (max_batch_size: true).
        if isinstance(value, bool) and info.field_name is not None:
            if cls.model_fields[info.field_name].annotation in _NUMBERS:
                raise ValueError("expected a number, not true/false")
        return value


class Defaults(_Frozen):
    """Stage-wide defaults for GenerationParams a request leaves unset."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0)
    stop: tuple[str, ...] = ()
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = None
    height: int | None = Field(None, ge=8)
    width: int | None = Field(None, ge=8)
    preview_every: int | None = Field(None, ge=0)


class Runtime(_Frozen):
    device: str = "cpu"
    # "auto": lock CUDA devices only; stages on a CPU do not share a memory budget.
    device_lock: Literal["auto", True, False] = "auto"
    lock_dir: Path | None = None
    max_batch_size: int = Field(1, ge=1, le=4096)
    max_queue_size: int = Field(64, ge=0, le=1_000_000)
    max_prompt_tokens: int = Field(4096, ge=1)
    max_message_bytes: int = Field(64 << 20, ge=1024)
    stage_init_timeout_s: float = Field(600.0, gt=0)
    download_stall_timeout_s: float = Field(60.0, gt=0)
    memory_ratio: float = Field(0.88, gt=0, le=1)
    page_size: int = Field(16, ge=1)
    drain_grace_s: float = Field(10.0, ge=0)
    output_queue_size: int = Field(256, ge=1)
    # Intra-op threads for torch in this process (None: torch's default, all
    # cores). Stages sharing a CPU node should split the cores between them.
    torch_threads: int | None = Field(None, ge=1)
    # Run each input window of a request through the engine as it arrives (a
    # decoder consuming windows of a windowed edge) instead of joining them first.
    streaming_input: bool = False
    # Data plane: tensors up to this size always travel inline; larger ones go by
    # shared memory (or CUDA IPC) to a consumer on this node that can open them.
    inline_max_bytes: int = Field(64 << 10, ge=0)
    shm: bool = True
    shm_ttl_s: float = Field(300.0, gt=0)  # a block nobody released is freed after this
    # Released shared blocks kept (pre-faulted, renamed) for later requests, in bytes.
    shm_pool_bytes: int = Field(256 << 20, ge=0)
    # Request input held in memory at once (services/mesh/data/byte_budget.py): unfinished
    # chunks, windows waiting for their last one, inputs of running requests. Per
    # stream, and for all streams of the process together.
    max_input_bytes: int = Field(1 << 30, ge=1024)
    max_process_input_bytes: int = Field(2 << 30, ge=1024)
    # Windows one request may have buffered before its last (each costs objects too).
    max_input_windows: int = Field(4096, ge=1)
    chunk_bytes: int = Field(CHUNK_BYTES, ge=1024)  # inline tensors above this go as chunks

    @property
    def uses_device_lock(self) -> bool:
        if self.device_lock == "auto":
            return self.device.startswith("cuda")
        return self.device_lock


class Segmenting(_Frozen):
    max_segment_tokens: int = Field(16, ge=1)
    min_flush_interval_ms: float = Field(50.0, ge=0)


class StageConfig(_Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    engine: str
    # None only with load_format: dummy, for an engine that builds from engine_args.
    model: str | None = Field(None, min_length=1)
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    defaults: Defaults = Defaults()
    runtime: Runtime = Runtime()
    segmenting: Segmenting = Segmenting()
    cache_dir: Path | None = None
    # TLS / mTLS and the mesh token (services.mesh.security); OMNI_* env overrides.
    security: SecuritySettings = SecuritySettings()

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        if engine not in ENGINES and not is_plugin(engine):
            known = ", ".join(sorted(ENGINES))
            raise ValueError(f"expected one of {known}, or a plug-in as package.module:ClassName")
        return engine

    @model_validator(mode="after")
    def _model_needed(self) -> StageConfig:
        if self.model is None and self.load_format != "dummy":
            raise ValueError("model: expected a model source (only load_format: dummy may omit it)")
        return self

    @property
    def resolved_cache_dir(self) -> Path:
        return (self.cache_dir or environment.CACHE_DIR.get()).expanduser()

    def engine_settings(self) -> EngineSettings:
        return EngineSettings(
            device=self.runtime.device,
            dtype=self.dtype,
            load_format=self.load_format,
            max_prompt_tokens=self.runtime.max_prompt_tokens,
            max_batch_size=self.runtime.max_batch_size,
            cache_dir=self.resolved_cache_dir,
            engine_args=dict(self.engine_args),
        )

    def apply_defaults(self, params: SamplingParams) -> SamplingParams:
        """A request's params with the stage defaults filled in where unset."""
        changes: dict[str, Any] = {}
        for key, value in self.defaults.model_dump(exclude_defaults=True).items():
            if key == "stop":
                if not params.stop:
                    changes["stop"] = tuple(value)
            elif getattr(params, key) is None:
                changes[key] = value
        return replace(params, **changes) if changes else params


def parse_stage_config(data: Any, source: str = "<stage config>") -> StageConfig:
    return config_files.validate(StageConfig, data, source)


def load_stage_config(path: str | Path) -> StageConfig:
    return config_files.load(StageConfig, path)
