"""``QwenOmniCode2Wav``: the code2wav vocoder of a Qwen3-Omni checkpoint as a
stage engine, decoding codes into audio as they arrive.

Codes come as [steps, num_code_groups] int64 windows (``runtime.streaming_input``
over a windowed edge, or all at once). The engine keeps each request's codes
and decodes every complete chunk of ``chunk_size`` codes the moment it has
one, with the ``left_context_size`` codes before it, and the rest when the
input ends: the same slices ``code2wav.chunked_decode`` cuts, so the joined
audio equals chunked_decode's on the whole codes however the windows fell.
Each chunk's audio is one "audio" segment (float32 mono, AudioFormat), in order.
Chunks of many requests are decoded together (decode_batch.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from services.engines.base import (
    AudioFormat,
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    ProgressOutput,
    TensorOutput,
)
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni import loading
from services.engines.qwen_omni.config import Code2WavArgs
from services.engines.qwen_omni.decode_batch import DecodeBatches
from services.engines.request_checks import refuse, refuse_unknown_tensors, tensor_field

logger = logging.getLogger(__name__)


@dataclass
class _Codes:
    """One request's codes not decoded yet, after the left context kept for them."""

    kept: list[torch.Tensor] = field(default_factory=list)  # [G, n] pieces, context first
    context: int = 0  # how many of the kept codes are left context (decoded already)
    decoded: int = 0  # codes decoded so far

    @property
    def held(self) -> int:
        return sum(p.shape[-1] for p in self.kept)


@dataclass(frozen=True)
class Code2WavPlan(EnginePlan):
    chunks: tuple[tuple[torch.Tensor, int], ...]  # (codes [1, G, context + n], context)


class QwenOmniCode2Wav:
    name: ClassVar[str] = "qwen_omni_code2wav"
    supported_params: ClassVar[frozenset[str]] = frozenset()
    output_tensors: ClassVar[tuple[str, ...]] = ("audio",)
    settings_model: ClassVar[type[Code2WavArgs]] = Code2WavArgs

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.args = Code2WavArgs.of(settings)
        self._model: Any = None
        self._groups = 0
        self._codebook = 0
        self._requests: OrderedDict[str, _Codes] = OrderedDict()
        self._batches: DecodeBatches | None = None

    def load(self, model_path: Path | None) -> ModelInfo:
        part = loading.load_engine_part(model_path, self.settings, self.name, "code2wav")
        self._model = part.model
        self._groups = part.config.code2wav_config.num_quantizers
        self._codebook = part.config.code2wav_config.codebook_size
        self._batches = DecodeBatches(self._decode, max(self.settings.max_batch_size, 1))
        return part.info

    def warmup(self) -> None:
        return None

    @property
    def audio_format(self) -> AudioFormat:
        return AudioFormat(self.args.sample_rate, 1)

    def check(self, request: EngineRequest) -> Code2WavPlan:
        refuse_unknown_tensors(request, (names.CODES,))
        where = tensor_field(names.CODES)
        codes = request.tensors.get(names.CODES)
        if codes is None:
            refuse(where, "missing: the talker's codes")
        if codes.dim() != 2 or codes.shape[1] != self._groups or codes.is_floating_point():
            refuse(where, f"expected integer codes [steps, {self._groups}], "
                   f"got {codes.dtype} {list(codes.shape)}")  # fmt: skip
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self._codebook):
            refuse(where, f"codes must be in [0, {self._codebook})")
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._keep(request.request_id)
        state.kept.append(codes.long().T)
        return Code2WavPlan(request, tuple(self._cut(state, final=False)))

    def input_ended(self, request_id: str) -> Code2WavPlan | None:
        state = self._requests.get(request_id)
        if state is None:
            return None
        return Code2WavPlan(EngineRequest(request_id), tuple(self._cut(state, final=True)))

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _cut(self, state: _Codes, *, final: bool) -> list[tuple[torch.Tensor, int]]:
        """The chunks ``state`` completes (and, when final, the rest), as chunked_decode
        slices them; the codes after them, and their left context, stay held."""
        size, left = self.args.chunk_size, self.args.left_context_size
        chunks = []
        while state.held - state.context >= size or (final and state.held > state.context):
            codes = torch.cat(state.kept, dim=-1)
            end = min(state.context + size, codes.shape[-1])
            chunks.append((codes[None, :, :end], state.context))
            state.decoded += end - state.context
            # chunked_decode's context: `left` codes back, or all of them near the start.
            context = min(left, state.decoded)
            state.kept = [codes[:, end - context :]]
            state.context = context
        return chunks

    async def generate(self, plan: Code2WavPlan) -> AsyncGenerator[EngineEvent, None]:
        upsample = int(self._model.total_upsample)
        fmt = self.audio_format
        assert self._batches is not None, "generate before load"
        for step, (codes, context) in enumerate(plan.chunks, 1):
            wav = await self._batches.decode(codes)
            audio = wav[0, 0, context * upsample :].float().cpu()
            yield TensorOutput({"audio": audio}, audio_format=fmt)
            yield ProgressOutput(step=step, total_steps=len(plan.chunks))
        yield FinishOutput("done", completion_tokens=len(plan.chunks))

    @property
    def batches(self) -> list[int]:
        """Chunks per code2wav forward, the last ones (metrics, tests)."""
        return [] if self._batches is None else list(self._batches.batches)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._model(codes.to(self.settings.device))
        return out

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        self._model = None
        self._requests.clear()

    def _keep(self, request_id: str) -> _Codes:
        state = self._requests[request_id] = _Codes()
        while len(self._requests) > self.args.max_streams:
            dropped, _ = self._requests.popitem(last=False)
            logger.warning("code2wav: dropped the held codes of request %s (max_streams)", dropped)
        return state
