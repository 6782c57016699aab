"""The stage file (YAML), validated once into frozen models (errors: see
services.mesh.config_files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from services.engines.base import EngineSettings
from services.engines.defaults import RequestDefaults
from services.engines.engine_args import EngineArgs, StageFacts, from_stage_file
from services.engines.registry import ENGINES, engine_class, is_plugin, settings_model
from services.mesh import config_files, environment
from services.mesh.config_files import Frozen
from services.mesh.data.chunks import CHUNK_BYTES
from services.mesh.rpc.limits import ConnectionLimits
from services.mesh.security import SecuritySettings


class Runtime(Frozen):
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
    # Tensors from pull_min_bytes up that shared memory cannot carry (a consumer on
    # another node) are pulled by their consumer from this stage's data port
    # (services/mesh/data/pull.py) rather than sent through the orchestrator.
    pull: bool = True
    pull_min_bytes: int = Field(1 << 20, ge=0)
    data_port: int = Field(0, ge=0, le=65535)  # 0: any free port
    # Connections, streams, idle and first-message limits of the stage's server
    # (services/mesh/rpc/limits.py), as the pipeline file's runtime.connections.
    connections: ConnectionLimits = ConnectionLimits()

    @property
    def uses_device_lock(self) -> bool:
        if self.device_lock == "auto":
            return self.device.startswith("cuda")
        return self.device_lock


class Segmenting(Frozen):
    max_segment_tokens: int = Field(16, ge=1)
    min_flush_interval_ms: float = Field(50.0, ge=0)
    # A request's first segment leaves as soon as it holds this many tokens (capped
    # at max_segment_tokens): the time to first token is the engine's, not the
    # batching's. Later segments wait for max_segment_tokens or the interval.
    first_segment_tokens: int = Field(1, ge=1)


class StageConfig(Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    engine: str
    # None only with load_format: dummy, for an engine that builds from engine_args.
    model: str | None = Field(None, min_length=1)
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: str | None = None
    # GenerationParams a request leaves unset (services/engines/defaults.py says what wins).
    defaults: RequestDefaults = RequestDefaults()
    runtime: Runtime = Runtime()
    # The engine's settings model (services/engines/engine_args.py); a plain mapping
    # for a plug-in without one. Declared after the keys its validation reads.
    engine_args: EngineArgs | dict[str, Any] = Field(default_factory=dict, validate_default=True)
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
        engine_class(engine)  # a plug-in that does not import is refused here, by name
        return engine

    @field_validator("engine_args", mode="plain")
    @classmethod
    def _engine_settings(cls, raw: Any, info: ValidationInfo) -> EngineArgs | dict[str, Any]:
        if "engine" not in info.data or "runtime" not in info.data:
            return {}  # the stage file is refused for those already
        facts = StageFacts(
            device=info.data["runtime"].device,
            dtype=info.data.get("dtype"),
            load_format=info.data.get("load_format", "auto"),
        )
        return from_stage_file(settings_model(info.data["engine"]), raw, facts)

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
            engine_args=self.engine_args,
            defaults=self.defaults,
        )


def parse_stage_config(data: Any, source: str = "<stage config>") -> StageConfig:
    return config_files.validate(StageConfig, data, source)


def load_stage_config(path: str | Path) -> StageConfig:
    return config_files.load(StageConfig, path)
