"""The three Qwen3-Omni engines loaded from one checkpoint folder, and a request
run through them in order the way the mesh hands it on (engine level, no wire)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engines.base import (
    EngineRequest,
    EngineSettings,
    SamplingParams,
    TensorOutput,
    TokenOutput,
)
from services.engines.defaults import RequestDefaults
from services.engines.qwen_omni import QwenOmniCode2Wav, QwenOmniTalker, QwenOmniThinker
from services.testing import engine_runs
from services.testing.engine_runs import collect, generate, tokens_of
from tests.engines.qwen_omni.reference import TALKER_TOKENS, THINKER_TOKENS


def settings(**engine_args: Any) -> EngineSettings:
    return EngineSettings(engine_args=engine_args)


def thinker(folder: Path) -> QwenOmniThinker:
    engine = QwenOmniThinker(
        EngineSettings(defaults=RequestDefaults(max_tokens=THINKER_TOKENS, temperature=0.0))
    )
    engine.load(folder)
    return engine


def talker(folder: Path) -> QwenOmniTalker:
    engine = QwenOmniTalker(
        EngineSettings(defaults=RequestDefaults(max_tokens=TALKER_TOKENS, temperature=0.0))
    )
    engine.load(folder)
    return engine


def code2wav(folder: Path, chunk_size: int = 300, left: int = 25) -> QwenOmniCode2Wav:
    engine = QwenOmniCode2Wav(settings(chunk_size=chunk_size, left_context_size=left))
    engine.load(folder)
    return engine


@dataclass(frozen=True)
class Thought:
    answer_ids: list[int]
    text: str
    handoff: dict[str, torch.Tensor]


async def think(engine: QwenOmniThinker, request: EngineRequest) -> Thought:
    """The thinker's answer and its whole hand-off, as a window -1 edge joins it (the
    answer's per-token rows as one "hidden_states" tensor)."""
    events = await collect(generate(engine, request))
    tensors: dict[str, torch.Tensor] = {}
    rows = []
    for event in events:
        if isinstance(event, TensorOutput):
            tensors.update(event.tensors)
        if isinstance(event, TokenOutput) and event.hidden_states is not None:
            rows.append(event.hidden_states)
    if rows:
        tensors["hidden_states"] = torch.cat(rows)
    text = "".join(getattr(e, "text", "") for e in events)
    return Thought(tokens_of(events), text, tensors)


async def talk(
    engine: QwenOmniTalker, thought: Thought, request_id: str = "r1", windows: int = 0
) -> torch.Tensor:
    """The codes [T, groups], joined from the talker's per-step outputs: the hand-off
    whole (a window -1 edge), or its answer in windows of ``windows`` tokens after a
    first window of the prompt's part and the first token, as a stage runs them
    (each window checked as it comes, run in order, then the input's end)."""
    ids, rows = list(thought.answer_ids), thought.handoff["hidden_states"]
    size = len(ids) if windows <= 0 else 1
    bounds = [0, size]
    while bounds[-1] < len(ids):
        bounds.append(min(bounds[-1] + max(windows, 1), len(ids)))
    plans = []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        tensors = dict(thought.handoff) if n == 0 else {}
        tensors["hidden_states"] = rows[a:b]
        window = EngineRequest(
            request_id, token_ids=tuple(ids[a:b]), tensors=tensors, params=SamplingParams()
        )
        plans.append(engine_runs.plan(engine, window))
    end = engine.input_ended(request_id)
    events = []
    for plan in [*plans, *([end] if end is not None else [])]:
        events += await collect(engine.generate(plan))
    engine.release(request_id)
    return torch.cat([e.tensors["codes"] for e in events if isinstance(e, TensorOutput)])


async def vocode(engine: QwenOmniCode2Wav, windows: list[torch.Tensor], rid: str = "r1") -> Any:
    """The audio segments of ``windows`` of codes sent in order, then the input's end."""
    pieces: list[torch.Tensor] = []
    plans = [engine.check(EngineRequest(rid, tensors={"codes": w})) for w in windows]
    end = engine.input_ended(rid)
    for plan in [*plans, *([end] if end is not None else [])]:
        for event in await collect(engine.generate(plan)):
            if isinstance(event, TensorOutput):
                pieces.append(event.tensors["audio"])
    engine.release(rid)
    return pieces
