"""An engine run the way a stage runs it, for engine tests: ``check`` plans the
request once, and ``generate`` runs that plan."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from services.engines.base import Engine, EngineEvent, EngineRequest, PlanT


def generate(engine: Engine[PlanT], request: EngineRequest) -> AsyncGenerator[EngineEvent, None]:
    return engine.generate(engine.check(request))
