"""Sixteen Qwen3-Omni requests (text, image and audio prompts, each its own question)
through the three engines, alone or many at once, with every logit row the thinker
and talker chose from recorded, and the rule their outputs are held to.

Batching changes the order of a product's additions (a GEMM over more rows, the
experts' tokens grouped otherwise, a convolution over a batch): on a CPU nothing
here is batch-invariant. So a request's outputs at N at once are compared with its
outputs alone as the packed-linear test compares a reordered path: against a
float64 run of the same request (``Reference``), every logit row within a small
multiple of the alone run's own float32 error, and every choice the same wherever
the float64 top two are further apart than that error could move them; a choice at
a near-tie may differ (and the request follows another path from there). Audio:
the same rule against float64 code2wav on the same codes.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from services.engines.base import EngineRequest, EngineSettings, SamplingParams
from services.engines.defaults import RequestDefaults
from services.engines.qwen_omni import QwenOmniCode2Wav, QwenOmniTalker, QwenOmniThinker
from tests.engines.qwen_omni import parts
from tests.engines.qwen_omni.reference import TALKER_TOKENS, THINKER_TOKENS, request
from tests.helpers.float_error import MULTIPLE, assert_float32_close

KINDS = ("text", "image", "audio")
QUESTIONS = (
    "Say something about this.", "What is it?", "Tell me more, please.", "Describe the colours.",
    "Is it big?", "Name one thing here.", "Why is that?", "Go on.", "What do you hear?",
    "Count to three.", "Is it loud?", "Give it a name.", "How does it feel?", "Say it again.",
    "What comes next?", "Sum it up.",
)  # fmt: skip
COUNTS = (1, 4, 8, 16)  # requests at once
CHUNK, CONTEXT = 12, 25  # code2wav's chunk and left context (the example pipeline's)


def omni_request(index: int, request_id: str) -> EngineRequest:
    """Request ``index``: its own question, after an image or a clip for two in three
    (the content parts in the order a client sends them: the media, then the text)."""
    base = request(KINDS[index % len(KINDS)], request_id)
    question = QUESTIONS[index % len(QUESTIONS)]
    turns = tuple(
        replace(t, content=question, parts=tuple(p if not isinstance(p, str) else question
                                                  for p in t.parts))
        for t in base.turns
    )  # fmt: skip
    return replace(base, messages=(("user", question),), turns=turns, params=SamplingParams())


@dataclass
class Spoken:
    """One request's outputs and the logit rows chosen from: "text" for the thinker,
    0 for the talker's first codebook, 1.. for the code predictor's groups."""

    ids: list[int]
    codes: torch.Tensor  # [T, G]
    audio: list[torch.Tensor]  # one piece per chunk
    logits: dict[object, list[torch.Tensor]] = field(default_factory=dict)


class Engines:
    """The three engines in one dtype, recording every logit row per request."""

    def __init__(self, folder: Path, dtype: str = "float32") -> None:
        def settings(**kwargs: object) -> EngineSettings:
            return EngineSettings(dtype=dtype, max_batch_size=16, **kwargs)  # type: ignore[arg-type]

        self.thinker = QwenOmniThinker(settings(defaults=RequestDefaults(
            max_tokens=THINKER_TOKENS, temperature=0.0)))  # fmt: skip
        self.talker = QwenOmniTalker(settings(defaults=RequestDefaults(
            max_tokens=TALKER_TOKENS, temperature=0.0)))  # fmt: skip
        self.code2wav = QwenOmniCode2Wav(
            settings(engine_args={"chunk_size": CHUNK, "left_context_size": CONTEXT})
        )
        for engine in (self.thinker, self.talker, self.code2wav):
            engine.load(folder)
        self.rows: dict[str, dict[object, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.thinker.scheduler.runner.watch = lambda rid, row: self._keep(rid, "text", row)
        self.talker.scheduler.runner.watch = self._keep

    def _keep(self, rid: str, kind: object, row: torch.Tensor) -> None:
        self.rows[rid][kind].append(row.double().cpu())

    async def speak(self, index: int, rid: str, windows: int = 2) -> Spoken:
        thought = await parts.think(self.thinker, omni_request(index, rid))
        codes = await parts.talk(self.talker, thought, rid, windows=windows)
        audio = await parts.vocode(self.code2wav, [codes], rid)
        return Spoken(thought.answer_ids, codes, audio, dict(self.rows.pop(rid)))

    async def many(self, count: int, tag: str) -> list[Spoken]:
        return list(await asyncio.gather(*(self.speak(i, f"{tag}{i}") for i in range(count))))

    def close(self) -> None:
        for engine in (self.thinker, self.talker, self.code2wav):
            engine.close()


def _decided(trusted: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether float32's error here could not swap the float64 top two."""
    finite = torch.isfinite(exact)
    t, e = trusted[finite], exact[finite]
    top = e.topk(2).values
    return float(top[0] - top[1]) > 2 * MULTIPLE * float((t - e).abs().max())


def decided(trusted: Spoken, exact: Spoken) -> bool:
    """Whether every choice of a request alone was decided: then batched it must make
    the very same ones."""
    return all(
        _decided(t, e)
        for kind, rows in trusted.logits.items()
        for t, e in zip(rows, exact.logits.get(kind, []), strict=False)
    )


def _diverges(kind: object, step: int, mine: torch.Tensor, trusted: torch.Tensor,
              exact: torch.Tensor) -> bool:  # fmt: skip
    """One logit row of ``kind`` at ``step``: ``mine`` within the rule of ``trusted``
    (both against ``exact``); True when the choices differ, which the rule allows only
    where the float64 top two are closer than float32's error here could move them."""
    finite = torch.isfinite(exact)  # the talker's suppressed ids are -inf in all three
    m, t, e = mine[finite], trusted[finite], exact[finite]
    where = f"{kind} step {step}"
    assert_float32_close(m[None], t[None], e[None])
    if _decided(t, e):
        assert int(m.argmax()) == int(e.argmax()), (where, "a decided choice differs")
    return int(m.argmax()) != int(t.argmax()) or int(t.argmax()) != int(e.argmax())


def assert_as_alone(mine: Spoken, trusted: Spoken, exact: Spoken) -> bool:
    """``mine`` (in a batch) against ``trusted`` (alone), both float32, and ``exact``
    (float64, alone), step by step until an undecided choice sends one of them another
    way. True when nothing did: then the ids, codes and audio are the same (the audio
    by the rule, from the same codes)."""
    for kind in trusted.logits:  # the thinker's first: the talker reads its answer
        rows = zip(mine.logits.get(kind, []), trusted.logits[kind], exact.logits.get(kind, []),
                   strict=False)  # fmt: skip
        for step, (m, t, e) in enumerate(rows):
            if _diverges(kind, step, m, t, e):
                return False  # near a tie; what follows is another request's path
    assert mine.ids == trusted.ids and torch.equal(mine.codes, trusted.codes)
    for m_audio, t_audio, e_audio in zip(mine.audio, trusted.audio, exact.audio, strict=True):
        assert_float32_close(m_audio[None], t_audio[None], e_audio[None])
    return True
