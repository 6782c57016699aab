"""Engine plug-ins behind one Protocol (see base.py), picked by name (registry.py)."""

from services.engines.base import (
    Engine,
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    ProgressOutput,
    SamplingParams,
    TensorOutput,
    TokenOutput,
)
from services.engines.registry import ENGINES, engine_class

__all__ = [
    "ENGINES",
    "Engine",
    "EngineEvent",
    "EnginePlan",
    "EngineRequest",
    "EngineSettings",
    "FinishOutput",
    "ModelInfo",
    "ProgressOutput",
    "SamplingParams",
    "TensorOutput",
    "TokenOutput",
    "engine_class",
]
