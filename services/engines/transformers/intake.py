"""Validating a request and turning it into a prompt plus resolved parameters.

The same function serves ``check`` at intake and ``generate`` itself, so the two
can never disagree about what a valid request is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn, cast

import jinja2
import torch
from transformers import BatchEncoding, PreTrainedTokenizerBase

from services.engines.base import EngineRequest
from services.engines.prompt_size import PromptBound
from services.engines.text_defaults import SamplingDefaults, max_new_tokens
from services.engines.transformers.sampling import Sampling
from services.mesh.errors import InvalidArgument

EMBEDS = "prompt_embeds"
_INPUTS = f"inputs.text, inputs.messages, inputs.token_ids or inputs.tensors.{EMBEDS}"


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
    def prompt_bound(self) -> PromptBound:
        return PromptBound(self.max_prompt_tokens, self.token_chars)


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
    defaults: SamplingDefaults,
) -> Plan:
    """Raises ``InvalidArgument`` naming the offending field."""
    field, token_ids, embeds = _prompt(request, tokenizer, limits)
    n = len(token_ids) if embeds is None else embeds.shape[0]
    if n == 0:
        raise InvalidArgument(f"{field}: the prompt is empty", field=field)
    if n > limits.max_prompt_tokens:
        raise InvalidArgument(
            f"{field}: prompt has {n} tokens, the limit is {limits.max_prompt_tokens}", field=field
        )
    room = limits.max_positions - n
    if room < 1:
        raise InvalidArgument(
            f"{field}: prompt has {n} tokens, the model's context is {limits.max_positions}",
            field=field,
        )
    where = "the model's context"
    if limits.kv_tokens is not None and limits.kv_tokens - n < room:
        pages = limits.kv_tokens // limits.page_size
        where = f"the stage's KV cache ({pages} x {limits.page_size}-token pages)"
        room = limits.kv_tokens - n
        if room < 1:
            raise InvalidArgument(
                f"{field}: prompt has {n} tokens and can never fit the stage's KV cache, "
                f"which holds {limits.kv_tokens} tokens ({pages} x {limits.page_size}-token "
                "pages) for the prompt and at least one new token",
                field=field,
            )
    p = request.params
    max_tokens = max_new_tokens(p.max_tokens, defaults.max_tokens, room, where)
    sampling = Sampling(
        temperature=defaults.temperature if p.temperature is None else p.temperature,
        top_p=defaults.top_p if p.top_p is None else p.top_p,
        top_k=defaults.top_k if p.top_k is None else p.top_k,
    )
    if not (sampling.temperature >= 0 and math.isfinite(sampling.temperature)):
        _bad("params.temperature", f"must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        _bad("params.top_p", f"must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        _bad("params.top_k", f"must be >= 0 (0 turns it off), got {sampling.top_k}")
    if p.seed is not None and not 0 <= p.seed < 2**63:
        _bad("params.seed", f"must be in [0, 2**63), got {p.seed}")
    if any(not s for s in p.stop):
        _bad("params.stop", "stop strings must not be empty")
    return Plan(
        token_ids=token_ids,
        embeds=embeds,
        max_tokens=max_tokens,
        sampling=sampling,
        seed=p.seed,
        stop=tuple(p.stop),
        return_hidden_states=p.return_hidden_states,
    )


def _prompt(
    request: EngineRequest, tokenizer: PreTrainedTokenizerBase, limits: Limits
) -> tuple[str, tuple[int, ...], torch.Tensor | None]:
    """(field, token ids, embeddings) of the request's one input."""
    for name in request.tensors:
        if name != EMBEDS:
            _bad(f"inputs.tensors.{name}", f"unknown tensor; this engine takes only {EMBEDS}")
    given = [
        name
        for name, present in (
            ("inputs.text", bool(request.text)),
            ("inputs.messages", bool(request.messages)),
            ("inputs.token_ids", bool(request.token_ids)),
            (f"inputs.tensors.{EMBEDS}", EMBEDS in request.tensors),
        )
        if present
    ]
    if len(given) != 1:
        found = ", ".join(given) or "none"
        _bad("inputs", f"exactly one of {_INPUTS} is required (found: {found})")
    field = given[0]
    # Sizes first: a prompt that cannot fit is refused before it costs tokenizing
    # (or a scan of its ids), whatever its size.
    bound = limits.prompt_bound
    if request.text:
        bound.check_text(field, request.text)
        ids = tokenizer(request.text)["input_ids"]
        return field, tuple(ids), None
    if request.messages:
        bound.check_messages(field, request.messages)
        return field, _chat(request.messages, tokenizer), None
    if request.token_ids:
        bound.check_count(field, len(request.token_ids))
        bad = [t for t in request.token_ids if not 0 <= t < limits.vocab_size]
        if bad:
            _bad(field, f"ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
        return field, tuple(request.token_ids), None
    embeds = request.tensors[EMBEDS]
    if embeds.dim() >= 1:
        bound.check_count(field, embeds.shape[0], "embedding rows")
    if embeds.dim() != 2 or embeds.shape[1] != limits.hidden_size or not embeds.is_floating_point():
        _bad(
            field,
            f"expected floats of shape [seq, {limits.hidden_size}], "
            f"got {embeds.dtype} of shape {list(embeds.shape)}",
        )
    if not bool(torch.isfinite(embeds.float()).all()):  # float8 has no isfinite of its own
        # A NaN or inf row makes every logit NaN: sampling from it fails, and the
        # batch it shares a step with must not fail with it.
        _bad(field, "expected finite values (found NaN or inf)")
    return field, (), embeds


def _chat(
    messages: tuple[tuple[str, str], ...], tokenizer: PreTrainedTokenizerBase
) -> tuple[int, ...]:
    field = "inputs.messages"
    if not tokenizer.chat_template:
        _bad(field, "this model has no chat template; send inputs.text instead")
    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        encoded = cast(
            BatchEncoding,
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=True
            ),
        )
    except jinja2.TemplateError as exc:
        # The template's own complaint (say, roles out of order) is meant for the user.
        _bad(field, f"the chat template refused these messages: {exc}")
    return tuple(encoded["input_ids"])


def _bad(field: str, why: str) -> NoReturn:
    raise InvalidArgument(f"{field}: {why}", field=field)
