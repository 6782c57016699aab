"""What only this engine knows of a text request, beside the shared text intake
(services/engines/text_intake.py, whose ``check`` reads it): the room its context
and the stage's KV plan leave (``Limits.room``), and its plan (``plan``): token ids
or embeddings and the sampling it draws with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engines import text_intake
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

    def room(self, prompt: text_intake.Prompt) -> tuple[int, str]:
        field, n = prompt.field, prompt.tokens
        room = self.max_positions - n
        if room < 1:
            refuse(field, f"prompt has {n} tokens, the model's context is {self.max_positions}")
        where = "the model's context"
        if self.kv_tokens is not None and self.kv_tokens - n < room:
            pages = self.kv_tokens // self.page_size
            where = f"the stage's KV cache ({pages} x {self.page_size}-token pages)"
            room = self.kv_tokens - n
            if room < 1:
                refuse(
                    field,
                    f"prompt has {n} tokens and can never fit the stage's KV cache, which holds "
                    f"{self.kv_tokens} tokens ({pages} x {self.page_size}-token pages) for "
                    "the prompt and at least one new token",
                )
        return room, where


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


def plan(checked: text_intake.Checked) -> Plan:
    """The engine's plan of a checked request: its prompt and how it samples."""
    prompt, chosen = checked.prompt, checked.sampling
    return Plan(
        token_ids=prompt.token_ids,
        embeds=prompt.embeds,
        max_tokens=chosen.max_tokens,
        sampling=Sampling(chosen.temperature, chosen.top_p, chosen.top_k),
        seed=chosen.seed,
        stop=chosen.stop,
        return_hidden_states=checked.request.params.return_hidden_states,
    )
