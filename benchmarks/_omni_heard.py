"""A Qwen3-Omni request as its client hears it (benchmarks/omni_concurrency.py): when
each audio packet came, how long it plays, whether the audio ran dry; waves of
requests sent at once."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import median
from orchestrator.client import AsyncClient, Result


@dataclass
class Heard:
    """One request as its client heard it."""

    first_audio_s: float = math.nan
    done_s: float = math.nan
    pieces: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds played)
    said: str = ""  # sha256 of the thinker's ids and the talker's codes
    audio: str = ""  # sha256 of every audio sample

    @property
    def audio_s(self) -> float:
        return sum(seconds for _, seconds in self.pieces)

    @property
    def real_time_factor(self) -> float:
        return self.pieces[-1][0] / self.audio_s if self.audio_s else math.inf

    @property
    def underruns(self) -> int:
        ends, late = self.pieces[0][0] + self.pieces[0][1], 0
        for arrival, seconds in self.pieces[1:]:
            late += arrival > ends
            ends = max(ends, arrival) + seconds
        return late


async def hear(
    client: AsyncClient, prompt: str, rid: str, play_scale: float, **params: Any
) -> Heard:
    heard, result = Heard(), Result()
    began = time.perf_counter()
    async for event in client.generate(prompt, request_id=rid, **params):
        result.add(event)
        if event.WhichOneof("kind") == "segment" and event.stage == "code2wav":
            fmt = event.segment.audio_format
            for tensor in event.segment.tensors:
                if tensor.name == "audio" and tensor.shape:
                    seconds = tensor.shape[0] / fmt.sample_rate * play_scale
                    heard.pieces.append((time.perf_counter() - began, seconds))
    heard.done_s = time.perf_counter() - began
    if not result.ok or not heard.pieces:
        raise RuntimeError(f"{rid}: {result.done} ({len(heard.pieces)} audio packets)")
    heard.first_audio_s = heard.pieces[0][0]
    said = hashlib.sha256(bytes(str(list(result.stages["thinker"].token_ids)), "ascii"))
    for tensor in result.stages["talker"].tensors.get("codes", []):
        said.update(tensor.raw)
    audio = hashlib.sha256()
    for tensor in result.stages["code2wav"].tensors.get("audio", []):
        audio.update(tensor.raw)
    heard.said, heard.audio = said.hexdigest(), audio.hexdigest()
    return heard


async def wave(
    client: AsyncClient, prompts: list[str], tag: str, play_scale: float, **params: Any
) -> tuple[float, list[Heard]]:
    began = time.perf_counter()
    heard = await asyncio.gather(
        *(hear(client, p, f"{tag}-{i}", play_scale, **params) for i, p in enumerate(prompts))
    )
    return time.perf_counter() - began, list(heard)


def percentile(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least ``p`` of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)] if ordered else math.nan


def spread(values: list[float], digits: int = 2) -> str:
    return f"{median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"
