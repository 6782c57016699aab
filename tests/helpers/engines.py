"""A plug-in engine for tests, loaded by a stage through the documented hook
(``engine: "tests.helpers.engines:ScriptedEngine"``): no model, and behaviour a
test can ask for by prompt.

    token ids   echoed back, one per step: what the stage received, in order
    "die"       one token, then the engine dies (``EngineDead``)
    "hold"      one token, then nothing until the request is cancelled
    "tensors N" N whole outputs named "frame" (values 0..N-1), no tokens, no flush between
    "speak N MS GAP"  N packets of MS ms of silence ("audio", 16 kHz), GAP ms apart
    other text  ``max_tokens`` tokens (ids 0, 1, …), one per step

It keeps state per request (``KeepsRequestState``): ``released`` lists the ids
the stage said were over, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import ClassVar

import torch

from services.engines.base import (
    AudioFormat,
    EngineEvent,
    EnginePlan,
    EngineSettings,
    FinishOutput,
    ProgressOutput,
    TensorOutput,
    TokenOutput,
)
from services.engines.defaults import DefaultLayers, resolve
from services.mesh.errors import EngineDead
from services.testing.fake_engine import FakeEngine


class ScriptedEngine(FakeEngine):
    name: ClassVar[str] = "scripted"
    supported_params: ClassVar[frozenset[str]] = frozenset({"max_tokens", "seed"})
    output_tensors: ClassVar[tuple[str, ...]] = ("frame", "audio")
    sample_rate: ClassVar[int] = 16_000
    description: ClassVar[str] = "scripted test engine"

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        self.dead = False
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    async def generate(self, plan: EnginePlan) -> AsyncGenerator[EngineEvent, None]:
        request = plan.request
        prompt = request.text or "".join(content for _role, content in request.messages)
        prompt_tokens = len(request.token_ids) or len(prompt.split())
        if self.dead:
            raise EngineDead("the scripted engine is dead")
        if request.token_ids:
            for token in request.token_ids:
                await asyncio.sleep(0)
                yield TokenOutput(token_ids=(token,), text=f"{token} ")
            count = len(request.token_ids)
            yield FinishOutput("done", prompt_tokens=count, completion_tokens=count)
            return
        if prompt.startswith("tensors "):
            for value in range(int(prompt.split()[1])):
                yield TensorOutput({"frame": torch.tensor([value])})
            yield FinishOutput("done")
            return
        if prompt.startswith("speak "):
            packets, packet_ms, gap_ms = (int(n) for n in prompt.split()[1:4])
            voice = AudioFormat(self.sample_rate)
            for packet in range(packets):
                if packet:
                    await asyncio.sleep(gap_ms / 1e3)
                samples = torch.zeros(self.sample_rate * packet_ms // 1000)
                yield TensorOutput({"audio": samples}, audio_format=voice)
                yield ProgressOutput(packet + 1, packets)  # sent now, as a vocoder's is
            yield FinishOutput("done")
            return
        if prompt.startswith("hold "):  # a long answer under way: N tokens, then held
            for token in range(int(prompt.split()[1])):
                await asyncio.sleep(0)
                yield TokenOutput(token_ids=(token,), text=f"{token} ")
            await asyncio.Event().wait()  # until cancelled
        yield TokenOutput(token_ids=(0,), text="0 ")
        if prompt == "die":
            self.dead = True
            raise EngineDead("the scripted engine died on request")
        if prompt == "hold":
            await asyncio.Event().wait()  # until cancelled
        # As a plug-in should: the stage's `defaults:` come in settings, not the request.
        count = resolve(request.params, DefaultLayers(self._settings.defaults)).max_tokens or 4
        for token in range(1, count):
            await asyncio.sleep(0)  # a step boundary, as a real engine has
            yield TokenOutput(token_ids=(token,), text=f"{token} ")
        yield FinishOutput("length", prompt_tokens=prompt_tokens, completion_tokens=count)
