"""Validating a request and turning it into a vLLM prompt and sampling arguments.

Plain Python over a Hugging Face tokenizer: it runs, and is tested, without vLLM.
``check`` and ``generate`` both call ``plan`` so they never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from services.engines.base import EngineRequest, SamplingParams
from services.engines.prompt_size import PromptBound
from services.engines.text_defaults import SamplingDefaults, max_new_tokens
from services.mesh.errors import InvalidArgument

EMBEDS = "prompt_embeds"
_EMBEDS_FIELD = f"inputs.tensors.{EMBEDS}"


@dataclass(frozen=True)
class Limits:
    """What the loaded model and the stage allow."""

    max_prompt_tokens: int
    max_model_len: int  # prompt plus completion
    vocab_size: int
    hidden_size: int
    prompt_embeds_enabled: bool
    # The most characters one token stands for (prompt_size.longest_token_chars).
    token_chars: int = 1


@dataclass(frozen=True)
class Plan:
    """A checked request: a vLLM prompt dict and resolved sampling arguments."""

    prompt: dict[str, Any]  # {"prompt_token_ids": [...]} or {"prompt_embeds": tensor}
    prompt_tokens: int
    sampling: dict[str, Any]  # keyword arguments of vllm.SamplingParams


def plan(
    request: EngineRequest,
    tokenizer: PreTrainedTokenizerBase,
    limits: Limits,
    defaults: SamplingDefaults,
) -> Plan:
    """Raises ``InvalidArgument`` naming the offending field."""
    prompt, prompt_tokens, field = _prompt(request, tokenizer, limits)
    if prompt_tokens == 0:
        raise InvalidArgument(f"{field}: the prompt is empty", field=field)
    if prompt_tokens > limits.max_prompt_tokens:
        raise InvalidArgument(
            f"{field}: prompt has {prompt_tokens} tokens, the limit is {limits.max_prompt_tokens}",
            field=field,
        )
    room = limits.max_model_len - prompt_tokens
    if room < 1:
        raise InvalidArgument(
            f"{field}: prompt fills the model's context of {limits.max_model_len}", field=field
        )
    return Plan(prompt, prompt_tokens, _sampling(request.params, defaults, room))


def _prompt(
    request: EngineRequest, tokenizer: PreTrainedTokenizerBase, limits: Limits
) -> tuple[dict[str, Any], int, str]:
    for name in request.tensors:
        if name != EMBEDS:
            raise InvalidArgument(
                f"unknown input tensor {name!r} (expected {EMBEDS!r})",
                field=f"inputs.tensors.{name}",
            )
    given = [
        name
        for name, present in (
            ("inputs.text", request.text is not None),
            ("inputs.messages", bool(request.messages)),
            ("inputs.token_ids", bool(request.token_ids)),
            (_EMBEDS_FIELD, EMBEDS in request.tensors),
        )
        if present
    ]
    if len(given) != 1:
        raise InvalidArgument(
            f"give exactly one of text, messages, token_ids or {EMBEDS}; got {given or 'none'}",
            field="inputs",
        )
    field = given[0]
    # Sizes first: a prompt that cannot fit is refused before it costs tokenizing.
    bound = PromptBound(limits.max_prompt_tokens, limits.token_chars)
    if field == _EMBEDS_FIELD:
        embeds = _embeds(request.tensors[EMBEDS], limits)
        return {EMBEDS: embeds}, embeds.shape[0], field
    if field == "inputs.token_ids":
        bound.check_count(field, len(request.token_ids))
        ids = list(request.token_ids)
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary of {limits.vocab_size}", field=field
            )
    elif field == "inputs.messages":
        bound.check_messages(field, request.messages)
        chat = [{"role": role, "content": content} for role, content in request.messages]
        try:
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # no template, or one that rejects these roles
            raise InvalidArgument(
                f"the model's chat template cannot render these messages ({type(exc).__name__})",
                field=field,
            ) from exc
        # The template already holds any BOS it wants.
        ids = tokenizer(str(text), add_special_tokens=False).input_ids
    else:
        bound.check_text(field, request.text or "")
        ids = tokenizer(request.text).input_ids
    return {"prompt_token_ids": ids}, len(ids), field


def _embeds(embeds: torch.Tensor, limits: Limits) -> torch.Tensor:
    if not limits.prompt_embeds_enabled:
        raise InvalidArgument(
            f"this stage does not take {EMBEDS} (engine_args.enable_prompt_embeds is off)",
            field=_EMBEDS_FIELD,
        )
    if not embeds.is_floating_point():
        raise InvalidArgument(f"{EMBEDS} must be a float tensor", field=_EMBEDS_FIELD)
    if embeds.ndim == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.ndim != 2 or embeds.shape[1] != limits.hidden_size:
        raise InvalidArgument(
            f"{EMBEDS} must be [seq, {limits.hidden_size}] or [1, seq, {limits.hidden_size}], "
            f"got {list(embeds.shape)}",
            field=_EMBEDS_FIELD,
        )
    # vLLM ships the prompt to its engine-core process: a compact CPU copy.
    return embeds.detach().cpu().contiguous()


def _sampling(params: SamplingParams, defaults: SamplingDefaults, room: int) -> dict[str, Any]:
    max_tokens = max_new_tokens(params.max_tokens, defaults.max_tokens, room)
    temperature = defaults.temperature if params.temperature is None else params.temperature
    top_p = defaults.top_p if params.top_p is None else params.top_p
    top_k = defaults.top_k if params.top_k is None else params.top_k
    if temperature < 0:
        raise InvalidArgument("params.temperature: must be >= 0", field="params.temperature")
    if not 0 < top_p <= 1:
        raise InvalidArgument("params.top_p: must be in (0, 1]", field="params.top_p")
    if top_k < 0:
        raise InvalidArgument("params.top_k: must be >= 0 (0: off)", field="params.top_k")
    if params.seed is not None and not 0 <= params.seed < 2**63:
        raise InvalidArgument("params.seed: must be in 0..2**63-1", field="params.seed")
    sampling: dict[str, Any] = {
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": list(params.stop),
    }
    if top_k > 0:  # vLLM versions disagree on how "off" is spelled (0 or -1): leave it unset
        sampling["top_k"] = top_k
    if params.seed is not None:
        sampling["seed"] = params.seed
    return sampling


def finish_reason(reason: str | None, stop_reason: int | str | None) -> str:
    """vLLM's finish reason in our words: it says "stop" for both an end-of-sequence
    token (no stop_reason) and a stop string or stop token (its stop_reason)."""
    if reason == "stop":
        return "eos" if stop_reason is None else "stop"
    return reason or "done"
