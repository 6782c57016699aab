"""What every no-model plug-in engine of the tests shares (``ScriptedEngine``,
``EchoTensorsEngine``, ``MediaEngine``): the Engine protocol's plumbing with nothing
to load, so each of them is only its ``generate``."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from services.engines.base import EnginePlan, EngineRequest, EngineSettings, ModelInfo


class FakeEngine:
    description: ClassVar[str] = "test engine"

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings

    def load(self, model_path: Path | None) -> ModelInfo:
        return ModelInfo(model_bytes=0, description=self.description)

    def warmup(self) -> None:
        pass

    def check(self, request: EngineRequest) -> EnginePlan:
        return EnginePlan(request)

    def close(self) -> None:
        pass
