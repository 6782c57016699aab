"""What the text engines (transformers, vllm) check of a request and turn into a
prompt, in one way: the one input (request_checks.py), its size before it costs
anything (prompt_size.py), token ids inside the vocabulary, chat messages
through the model's chat template, ``prompt_embeds`` of the model's width and
finite, and sampling parameters resolved (defaults.py) and in range, within the
room the prompt leaves (``check``: each engine's limits say what that room is).
Each engine's intake turns what ``check`` found into its plan, ``TextPlan``'s
``resolved``. Diffusers checks its ``prompt_embeds`` with ``check_embeds`` too.

Plain Python over a Hugging Face tokenizer; refusals are INVALID_ARGUMENT
naming the field. ``check`` serves an engine's ``check`` at intake and its
``generate`` alike, so the two can never disagree about what a valid request is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

import jinja2
import torch
from transformers import BatchEncoding, PreTrainedTokenizerBase

from services.engines.base import EnginePlan, EngineRequest, SamplingParams
from services.engines.defaults import DefaultLayers, resolve
from services.engines.prompt_size import PromptBound
from services.engines.request_checks import (
    MESSAGES,
    TEXT,
    TOKEN_IDS,
    check_seed,
    one_input,
    refuse,
    refuse_unknown_tensors,
    tensor_field,
)

EMBEDS = "prompt_embeds"
EMBEDS_FIELD = tensor_field(EMBEDS)
INPUTS = (TEXT, MESSAGES, TOKEN_IDS, EMBEDS_FIELD)


@dataclass(frozen=True)
class PromptLimits:
    """What the loaded model and the stage allow of a prompt."""

    max_tokens: int  # runtime.max_prompt_tokens
    vocab_size: int  # rows of the input embedding
    hidden_size: int
    # The most characters one token stands for (prompt_size.longest_token_chars).
    token_chars: int = 1
    # Why this stage takes no prompt_embeds; "" when it takes them.
    no_embeds: str = ""

    @property
    def bound(self) -> PromptBound:
        return PromptBound(self.max_tokens, self.token_chars)


@dataclass(frozen=True)
class Prompt:
    field: str  # the input it came from
    token_ids: tuple[int, ...]  # () when it comes as embeddings
    embeds: torch.Tensor | None  # [seq, hidden]

    @property
    def tokens(self) -> int:
        return len(self.token_ids) if self.embeds is None else int(self.embeds.shape[0])


class TextLimits(Protocol):
    """What a text engine's limits (its intake's ``Limits``) say of a request."""

    @property
    def prompt(self) -> PromptLimits: ...

    def room(self, prompt: Prompt) -> tuple[int, str]:
        """The new tokens ``prompt`` leaves room for, and where ("the model's context"),
        refusing a prompt that leaves none."""
        ...


@dataclass(frozen=True)
class Checked:
    """A text request as ``check`` found it: its prompt, and its sampling parameters
    within the room the prompt leaves."""

    request: EngineRequest
    prompt: Prompt
    sampling: TextSampling


def check(
    request: EngineRequest,
    tokenizer: PreTrainedTokenizerBase,
    limits: TextLimits,
    defaults: DefaultLayers,
) -> Checked:
    """Raises ``InvalidArgument`` naming the offending field."""
    prompt = read_prompt(request, tokenizer, limits.prompt)
    room, where = limits.room(prompt)
    return Checked(request, prompt, sampling(request.params, defaults, room, where))


P = TypeVar("P")


@dataclass(frozen=True)
class TextPlan(EnginePlan, Generic[P]):
    """A text engine's plan: the request, and what its intake resolved (the prompt
    tokenized or templated, the parameters resolved)."""

    resolved: P


def read_prompt(
    request: EngineRequest, tokenizer: PreTrainedTokenizerBase, limits: PromptLimits
) -> Prompt:
    """The request's one input as token ids or embeddings, neither empty nor over
    ``limits.max_tokens``."""
    refuse_unknown_tensors(request, (EMBEDS,))
    field = one_input(request, INPUTS)
    # Sizes first: a prompt that cannot fit is refused before it costs tokenizing
    # (or a scan of its ids), whatever its size.
    bound = limits.bound
    if field == TEXT:
        text = cast(str, request.text)
        bound.check_text(field, text)
        prompt = Prompt(field, tuple(tokenizer(text)["input_ids"]), None)
    elif field == MESSAGES:
        bound.check_messages(field, request.messages)
        prompt = Prompt(field, _chat(request.messages, tokenizer), None)
    elif field == TOKEN_IDS:
        bound.check_count(field, len(request.token_ids))
        bad = [t for t in request.token_ids if not 0 <= t < limits.vocab_size]
        if bad:
            refuse(field, f"ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
        prompt = Prompt(field, tuple(request.token_ids), None)
    else:
        if limits.no_embeds:
            refuse(field, limits.no_embeds)
        embeds = check_embeds(request.tensors[EMBEDS], limits.hidden_size, bound)
        prompt = Prompt(field, (), embeds)
    if prompt.tokens == 0:
        refuse(field, "the prompt is empty")
    if prompt.tokens > limits.max_tokens:
        refuse(field, f"prompt has {prompt.tokens} tokens, the limit is {limits.max_tokens}")
    return prompt


def check_embeds(
    embeds: torch.Tensor, width: int | None, bound: PromptBound | None = None
) -> torch.Tensor:
    """``prompt_embeds`` as [seq, width] (a leading batch of one dropped): floats,
    all finite; ``width`` None: any. Rows are counted before anything scans them."""
    field = EMBEDS_FIELD
    if bound is not None and embeds.dim() >= 2:
        bound.check_count(field, embeds.shape[-2], "embedding rows")
    rows = embeds[0] if embeds.dim() == 3 and embeds.shape[0] == 1 else embeds
    if rows.dim() != 2 or not embeds.is_floating_point() or width not in (None, rows.shape[1]):
        shape = f"[seq, {width or 'dim'}]"
        refuse(
            field,
            f"expected floats of shape {shape} or [1, seq, {width or 'dim'}], "
            f"got {embeds.dtype} of shape {list(embeds.shape)}",
        )
    if rows.shape[0] == 0:
        refuse(field, "the prompt is empty")
    if not bool(torch.isfinite(rows.float()).all()):  # float8 has no isfinite of its own
        # A NaN or inf row makes every logit NaN: sampling from it fails, and the
        # batch it shares a step with must not fail with it.
        refuse(field, "expected finite values (found NaN or inf)")
    return rows


def _chat(
    messages: Sequence[tuple[str, str]], tokenizer: PreTrainedTokenizerBase
) -> tuple[int, ...]:
    if not tokenizer.chat_template:
        refuse(MESSAGES, "this model has no chat template; send inputs.text instead")
    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        encoded = cast(
            BatchEncoding,
            # The template holds any BOS it wants: no special tokens are added.
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=True
            ),
        )
    except jinja2.TemplateError as exc:
        # The template's own complaint (say, roles out of order) is meant for the user.
        refuse(MESSAGES, f"the chat template refused these messages: {exc}")
    return tuple(encoded["input_ids"])


@dataclass(frozen=True)
class TextSampling:
    """A text request's sampling parameters, resolved and checked."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0: no top-k cut
    seed: int | None
    stop: tuple[str, ...]


def sampling(
    params: SamplingParams, defaults: DefaultLayers, room: int, where: str
) -> TextSampling:
    """``params`` with their defaults (defaults.resolve), checked; ``room`` is what
    the prompt leaves in ``where`` for new tokens."""
    p = resolve(params, defaults)
    # The text engines' built-in layer (defaults.TEXT_BUILT_IN) sets all four.
    assert p.max_tokens is not None and p.temperature is not None
    assert p.top_p is not None and p.top_k is not None
    if not (p.temperature >= 0 and math.isfinite(p.temperature)):
        refuse("params.temperature", f"must be a finite number >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        refuse("params.top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        refuse("params.top_k", f"must be >= 0 (0 turns it off), got {p.top_k}")
    check_seed(p.seed)
    if any(not s for s in p.stop):
        refuse("params.stop", "stop strings must not be empty")
    return TextSampling(
        # Only the request's own max_tokens must fit; a default is cut to fit.
        max_tokens=max_new_tokens(params.max_tokens, p.max_tokens, room, where),
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop=tuple(p.stop),
    )


def max_new_tokens(
    asked: int | None, default: int, room: int, where: str = "the model's context"
) -> int:
    """The tokens a request may generate in the ``room`` its prompt leaves in
    ``where``: an explicit value must fit (INVALID_ARGUMENT otherwise); an unset
    one is cut to fit."""
    if asked is None:
        return min(default, room)
    if not 1 <= asked <= room:
        refuse(
            "params.max_tokens",
            f"must be between 1 and {room} (the room the prompt leaves in {where}), got {asked}",
        )
    return asked
