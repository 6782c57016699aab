"""One text request under the scheduler: its prompt, progress, sampler and text.

The scheduler and the runner own every ``TextRequest`` while it runs (the runner reads
its prompt and hands it each new token); the request's ``generate`` only reads what
``deliver`` hands it and may set ``cancelled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from services.engines.base import EngineEvent, FinishOutput, FinishReason, TokenOutput
from services.engines.detokenizer import IncrementalDetokenizer
from services.engines.sampling import greedy_tokens, sample
from services.engines.scheduler import Delivery, Outbox
from services.engines.transformers.intake import Plan
from services.engines.transformers.text import StopStrings

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TextRequest:
    request_id: str
    plan: Plan
    tokenizer: PreTrainedTokenizerBase
    generator: torch.Generator
    deliver: Callable[[Delivery], None]  # thread-safe: called on the model thread
    submitted: float
    eos_ids: frozenset[int]
    admitted: float = 0.0
    prefilled: int = 0  # prompt tokens already through the model
    completion: int = 0
    last_token: int = -1
    # Set from the event loop; read by the model thread at step boundaries only.
    cancelled: bool = False
    finished: bool = False
    _detok: IncrementalDetokenizer = field(init=False)
    _stops: StopStrings = field(init=False)

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.plan.token_ids)
        self._stops = StopStrings(self.plan.stop)

    @property
    def ready(self) -> bool:
        return True  # a text request's next input is its own last token

    @property
    def prompt_tokens(self) -> int:
        return self.plan.prompt_tokens

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_tokens - self.prefilled

    @property
    def final_length(self) -> int:
        """Tokens its KV rows may hold at most: the prompt and every new token."""
        return self.prompt_tokens + self.plan.max_tokens

    def prompt_chunk(self, count: int, embed: torch.nn.Module) -> torch.Tensor:
        """The next ``count`` prompt positions as embeddings [count, hidden]."""
        start, end = self.prefilled, self.prefilled + count
        self.prefilled = end
        weight = next(embed.parameters())
        if self.plan.embeds is not None:
            return self.plan.embeds[start:end].to(device=weight.device, dtype=weight.dtype)
        ids = torch.tensor(self.plan.token_ids[start:end], device=weight.device)
        return embed(ids)

    def add_token(self, token: int, hidden: torch.Tensor | None) -> list[EngineEvent]:
        """The events one new token makes; the last is a FinishOutput when it ends the request."""
        self.completion += 1
        self.last_token = token
        stops = self._stops
        text = stops.add(self._detok.add(token))
        reason: FinishReason | None = None
        if stops.stopped:
            reason = "stop"
        elif token in self.eos_ids:
            reason = "eos"
        elif self.completion >= self.plan.max_tokens:
            reason = "length"
        if reason is not None and reason != "stop":
            # The text ends here: release what was held back for a character or a
            # stop string that can no longer complete.
            text += stops.add(self._detok.flush())
            reason = "stop" if stops.stopped else reason
            text += stops.flush()
        token_output = TokenOutput(token_ids=(token,), text=text, hidden_states=hidden)
        events: list[EngineEvent] = [token_output]
        if reason is not None:
            events.append(self.finish(reason))
        return events

    def finish(self, reason: FinishReason) -> FinishOutput:
        self.finished = True
        return FinishOutput(
            reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion,
            queue_ms=max(self.admitted - self.submitted, 0.0) * 1e3,
        )


def emit_tokens(
    rows: list[TextRequest],
    which: list[int],
    logits: torch.Tensor,
    states: torch.Tensor | None,
    outbox: Outbox[TextRequest],
) -> None:
    """Pick the next token of each row in ``which`` (its logits and, if it asked,
    its hidden state row) and queue the events that follow in ``outbox``."""
    every = which == list(range(len(logits)))
    greedy = greedy_tokens(logits if every else logits[which])
    for n, i in enumerate(which):
        request = rows[i]
        sampling = request.plan.sampling
        try:
            token = greedy[n] if sampling.greedy else sample(logits[i], sampling, request.generator)
        except RuntimeError as exc:  # its logits hold NaN or inf: this request's alone
            logger.exception("request %s: sampling failed", request.request_id)
            request.finished = True
            request.deliver(exc)
            continue
        row = None
        if states is not None and request.plan.return_hidden_states:
            # A copy, so the event does not pin the whole batch's activations.
            row = states[i : i + 1].to("cpu", torch.float32, copy=True)
        outbox.setdefault(request, []).extend(request.add_token(token, row))
