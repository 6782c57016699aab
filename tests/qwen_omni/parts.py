"""The three Qwen3-Omni engines loaded from one checkpoint folder, and a request
run through them in order the way the mesh hands it on (engine level, no wire)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engines.base import (
    EngineRequest,
    EngineSettings,
    SamplingParams,
    TensorOutput,
)
from services.engines.defaults import RequestDefaults
from services.engines.qwen_omni import QwenOmniCode2Wav, QwenOmniTalker, QwenOmniThinker
from tests.helpers.engine_runs import collect, generate, tokens_of
from tests.qwen_omni.reference import TALKER_TOKENS, THINKER_TOKENS


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
    events = await collect(generate(engine, request))
    tensors: dict[str, torch.Tensor] = {}
    for event in events:
        if isinstance(event, TensorOutput):
            tensors.update(event.tensors)
    text = "".join(getattr(e, "text", "") for e in events)
    return Thought(tokens_of(events), text, tensors)


async def talk(engine: QwenOmniTalker, thought: Thought, request_id: str = "r1") -> torch.Tensor:
    """The codes [T, groups], joined from the talker's per-step outputs."""
    request = EngineRequest(
        request_id, token_ids=tuple(thought.answer_ids), tensors=thought.handoff,
        params=SamplingParams(),
    )  # fmt: skip
    events = await collect(generate(engine, request))
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
