"""``QwenOmniTalker``: the talker of a Qwen3-Omni checkpoint (with its code predictor)
as a stage engine, batched under the shared scheduler (talker_runner.py).

Its input is the thinker's hand-off (config.py), whole (a window -1 edge) or window
by window as the thinker writes (``runtime.streaming_input``): each window's rows
are fed to the request the moment the stage takes the checked window (``take``),
so its talker steps while the thinker goes on; a window's ``generate`` hands out
the codes made until the talker has used every row it was given (or has
finished), and ``input_ended`` (the thinker's answer is whole: where the text
ends) the rest. The codes of each step
([1, num_code_groups] int64: the step's token and its residual codes) are one
segment each, so the edge to code2wav can be windowed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from services.engines.base import (
    EngineEvent,
    EnginePlan,
    EngineRequest,
    EngineSettings,
    ModelInfo,
)
from services.engines.defaults import DefaultLayers, RequestDefaults, resolve
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni import loading
from services.engines.qwen_omni.config import TalkerArgs
from services.engines.qwen_omni.handoff import Handoff
from services.engines.qwen_omni.sampling import CodeSampling
from services.engines.qwen_omni.talker_intake import answer_rows, first_handoff
from services.engines.qwen_omni.talker_runner import TalkerRequest, TalkerRunner
from services.engines.request_checks import check_seed, refuse, refuse_unknown_tensors
from services.engines.sampling import Sampling
from services.engines.scheduler import EngineShell, Inbox, Limits, Scheduler
from services.mesh.errors import InitFailed


@dataclass
class _Talk:
    """One request's talker state across its windows, and its events not yet handed
    out (its inbox, made on the event loop by its first ``generate``)."""

    request: TalkerRequest
    inbox: Inbox | None = None


@dataclass(frozen=True)
class TalkerPlan(EnginePlan):
    talk: _Talk
    # A later window's answer ids and rows, fed to the request by ``take``; None for
    # the first window (its rows are in the request's hand-off already).
    rows: tuple[list[int], torch.Tensor] | None = None
    final: bool = False  # the input has ended: run to the talker's end


class QwenOmniTalker:
    name: ClassVar[str] = "qwen_omni_talker"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"max_tokens", "temperature", "top_p", "top_k", "seed", "extra.speaker",
         "extra.repetition_penalty"}
    )  # fmt: skip
    output_tensors: ClassVar[tuple[str, ...]] = (names.CODES,)
    settings_model: ClassVar[type[TalkerArgs]] = TalkerArgs

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.args = TalkerArgs.of(settings)
        built_in = RequestDefaults(
            max_tokens=self.args.max_new_tokens, temperature=self.args.temperature,
            top_p=self.args.top_p, top_k=self.args.top_k,
        )  # fmt: skip
        self._defaults = DefaultLayers(settings.defaults, built_in=built_in)
        self._model: Any = None
        self._config: Any = None
        self._shell: EngineShell[TalkerRequest] = EngineShell(self.name, settings.device)
        self._talks: dict[str, _Talk] = {}

    def load(self, model_path: Path | None) -> ModelInfo:
        part = loading.load_engine_part(model_path, self.settings, self.name, "talker")
        self._model, self._config = part.model, part.config
        speakers = self._config.talker_config.speaker_id
        if self.args.speaker not in speakers:
            raise InitFailed(
                f"engine_args.speaker: unknown speaker {self.args.speaker!r} "
                f"(offered: {sorted(speakers)})",
                field="engine_args.speaker",
            )
        # Whole prompts (prefill_tokens None): a talker's prompt is built at once from
        # the thinker's hand-off (handoff.py) and read in one forward.
        limits = Limits(max_batch_size=self.settings.max_batch_size)
        self._shell.start(TalkerRunner(self._model, self._config), limits, "talker-steps")
        return part.info

    def warmup(self) -> None:
        return None

    @property
    def scheduler(self) -> Scheduler[TalkerRequest]:
        return self._shell.scheduler

    # -- a request's windows ------------------------------------------------------

    def check(self, request: EngineRequest) -> TalkerPlan:
        refuse_unknown_tensors(request, names.HANDOFF)
        talk = self._talks.get(request.request_id)
        size = self._config.talker_config.thinker_hidden_size
        if talk is not None:  # a later window: its rows, fed when it is taken
            return TalkerPlan(request, talk, rows=answer_rows(request, size))
        talk = _Talk(self._request(request, first_handoff(request, size)))
        return TalkerPlan(request, talk)

    def take(self, plan: TalkerPlan) -> None:
        """A checked window, used now (capabilities.TakesWindowsEarly): the first one
        makes the request known for its later windows; a later one's rows join its
        hand-off at once, so the talker steps on while the thinker writes."""
        if plan.rows is None:
            self._talks[plan.request.request_id] = plan.talk
            return
        plan.talk.request.handoff.add(*plan.rows)
        self.scheduler.wake()

    def _request(self, request: EngineRequest, handoff: Handoff) -> TalkerRequest:
        params = resolve(request.params, self._defaults)
        check_seed(params.seed)
        extra = dict(params.extra)
        talker = self._config.talker_config
        speakers = talker.speaker_id
        speaker = str(extra.get("speaker", self.args.speaker)).lower()
        if speaker not in speakers:
            refuse(
                "params.extra.speaker", f"unknown speaker {speaker!r} (offered: {list(speakers)})"
            )
        penalty = extra.get("repetition_penalty", self.args.repetition_penalty)
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or penalty <= 0:
            refuse("params.extra.repetition_penalty", f"expected a number > 0, got {penalty!r}")
        vocab = talker.text_config.vocab_size
        # As the monolithic model: the top 1024 ids are special, but the end.
        suppress = torch.zeros(vocab, dtype=torch.bool, device=self.settings.device)
        suppress[vocab - 1024 :] = True
        suppress[talker.codec_eos_token_id] = False
        generator = self._shell.generator(params.seed)
        first = Sampling(params.temperature or 0.0, params.top_p or 1.0, params.top_k or 0)
        return TalkerRequest(
            request_id=request.request_id,
            handoff=handoff.to(self.settings.device),
            speaker_id=speakers[speaker],
            sampling=CodeSampling(first, float(penalty), suppress, generator),
            max_tokens=params.max_tokens or 1,
            deliver=None,
            submitted=time.monotonic(),
        )

    def input_ended(self, request_id: str) -> TalkerPlan | None:
        talk = self._talks.get(request_id)
        if talk is None:
            return None
        talk.request.handoff.ended = True  # the talker may read where the text ends now
        self.scheduler.wake()
        return TalkerPlan(EngineRequest(request_id), talk, final=True)

    def release(self, request_id: str) -> None:
        talk = self._talks.pop(request_id, None)
        if talk is not None:
            self._shell.cancel(talk.request)

    # -- running ------------------------------------------------------------------

    async def generate(self, plan: TalkerPlan) -> AsyncGenerator[EngineEvent, None]:
        """This window's codes: to where the talker has used every row it was given,
        or, once the input has ended, to its end."""
        talk = plan.talk
        if talk.inbox is None:
            talk.inbox = Inbox()
            talk.request.deliver = talk.inbox.deliver
            self._shell.submit(talk.request)
        events = talk.inbox.events() if plan.final else talk.inbox.window(talk.request)
        async for event in events:
            yield event

    def close(self) -> None:
        self._shell.close()
        self._model = None
        self._talks.clear()
