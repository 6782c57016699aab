"""Validating a request and turning it into a prompt plus resolved parameters:
the shared text intake (services/engines/text_intake.py) and what only this
engine knows, the room its context and the stage's KV plan leave.

The same function serves ``check`` at intake and ``generate`` itself, so the two
can never disagree about what a valid request is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from services.engines import text_intake
from services.engines.base import EngineRequest
from services.engines.defaults import DefaultLayers
from services.engines.request_checks import refuse
from services.engines.sampling import Sampling

EMBEDS = text_intake.EMBEDS


@dataclass(frozen=True)
class Limits:
    """What the loaded model and the stage allow."""

    max_prompt_tokens: int
    max_positions: int  # the model's context length
    vocab_size: int  # rows of the input embedding
    hidden_size: int
    # The stage's KV plan in tokens (pages * page_size); None without a plan.
    kv_tokens: int | None = None
    page_size: int = 16
    # The most characters one token stands for (prompt_size.longest_token_chars):
    # the text a prompt may have before tokenizing it is pointless.
    token_chars: int = 1

    @property
    def prompt(self) -> text_intake.PromptLimits:
        return text_intake.PromptLimits(
            self.max_prompt_tokens, self.vocab_size, self.hidden_size, self.token_chars
        )


@dataclass(frozen=True)
class Plan:
    """A checked request, ready to run."""

    token_ids: tuple[int, ...]  # the prompt, or () when it comes as embeddings
    embeds: torch.Tensor | None  # [seq, hidden]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stop: tuple[str, ...]
    return_hidden_states: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids) if self.embeds is None else self.embeds.shape[0]


def plan(
    request: EngineRequest,
    tokenizer: PreTrainedTokenizerBase,
    limits: Limits,
    defaults: DefaultLayers,
) -> Plan:
    """Raises ``InvalidArgument`` naming the offending field."""
    prompt = text_intake.read_prompt(request, tokenizer, limits.prompt)
    field, n = prompt.field, prompt.tokens
    room = limits.max_positions - n
    if room < 1:
        refuse(field, f"prompt has {n} tokens, the model's context is {limits.max_positions}")
    where = "the model's context"
    if limits.kv_tokens is not None and limits.kv_tokens - n < room:
        pages = limits.kv_tokens // limits.page_size
        where = f"the stage's KV cache ({pages} x {limits.page_size}-token pages)"
        room = limits.kv_tokens - n
        if room < 1:
            refuse(
                field,
                f"prompt has {n} tokens and can never fit the stage's KV cache, which holds "
                f"{limits.kv_tokens} tokens ({pages} x {limits.page_size}-token pages) for "
                "the prompt and at least one new token",
            )
    chosen = text_intake.sampling(request.params, defaults, room, where)
    return Plan(
        token_ids=prompt.token_ids,
        embeds=prompt.embeds,
        max_tokens=chosen.max_tokens,
        sampling=Sampling(chosen.temperature, chosen.top_p, chosen.top_k),
        seed=chosen.seed,
        stop=chosen.stop,
        return_hidden_states=request.params.return_hidden_states,
    )
