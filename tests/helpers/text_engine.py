"""Driving the transformers engine in tests: requests, and a run's tokens, text and finish."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from services.engines.base import (
    EngineEvent,
    EngineRequest,
    FinishOutput,
    ModelInfo,
    SamplingParams,
    TokenOutput,
)
from services.engines.transformers import TransformersEngine

FRANCE = (("user", "What is the capital of France?"),)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@dataclass(frozen=True)
class Tiny:
    """A tiny random-weight engine and what its load reported."""

    engine: TransformersEngine
    info: ModelInfo


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    hidden: list[torch.Tensor | None] = field(default_factory=list)
    finish: FinishOutput | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect(events: AsyncIterator[EngineEvent], taken: int = 0) -> Result:
    """The rest of a run, ``taken`` tokens of it already read by the caller."""
    result = Result()
    async for event in events:
        assert result.finish is None, "nothing may follow FinishOutput"
        if isinstance(event, TokenOutput):
            result.tokens.extend(event.token_ids)
            result.texts.append(event.text)
            result.hidden.append(event.hidden_states)
        else:
            assert isinstance(event, FinishOutput)
            result.finish = event
    assert result.finish is not None
    assert result.finish.completion_tokens == taken + len(result.tokens)
    return result


def req(rid: str = "r", params: SamplingParams = GREEDY, **inputs: object) -> EngineRequest:
    return EngineRequest(request_id=rid, params=params, **inputs)  # type: ignore[arg-type]
