"""An engine run the way a stage runs it, for engine tests: ``plan`` plans the
request once (as the stage does: capabilities.planned), and ``generate`` runs that
plan; ``collect`` drains a run, bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from services.engines.base import Engine, EngineEvent, EngineRequest, PlanT, TokenOutput
from services.engines.capabilities import planned


def plan(engine: Engine[PlanT], request: EngineRequest) -> PlanT:
    """``request`` planned as a stage plans it (capabilities.planned)."""
    return planned(engine, request)


def generate(engine: Engine[PlanT], request: EngineRequest) -> AsyncGenerator[EngineEvent, None]:
    return engine.generate(plan(engine, request))


async def collect(stream: AsyncIterator[EngineEvent], timeout_s: float = 120) -> list[EngineEvent]:
    """Every event of ``stream``; a run that hangs fails after ``timeout_s``."""

    async def drain() -> list[EngineEvent]:
        return [event async for event in stream]

    return await asyncio.wait_for(drain(), timeout_s)


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenOutput) for t in e.token_ids]
