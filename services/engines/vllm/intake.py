"""A text request in vLLM's terms, beside the shared text intake
(services/engines/text_intake.py, whose ``check`` reads it): the room its context
leaves (``Limits.room``), a vLLM prompt and sampling arguments (``plan``), and
vLLM's finish reasons in ours.

Plain Python: it runs, and is tested, without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engines import text_intake
from services.engines.request_checks import refuse
from services.mesh.finish import FinishReason

EMBEDS = text_intake.EMBEDS


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

    @property
    def prompt(self) -> text_intake.PromptLimits:
        no_embeds = (
            ""
            if self.prompt_embeds_enabled
            else f"this stage does not take {EMBEDS} (engine_args.enable_prompt_embeds is off)"
        )
        return text_intake.PromptLimits(
            self.max_prompt_tokens, self.vocab_size, self.hidden_size, self.token_chars, no_embeds
        )

    def room(self, prompt: text_intake.Prompt) -> tuple[int, str]:
        room = self.max_model_len - prompt.tokens
        if room < 1:
            refuse(prompt.field, f"prompt fills the model's context of {self.max_model_len}")
        return room, "the model's context"


@dataclass(frozen=True)
class Plan:
    """A checked request: a vLLM prompt dict and resolved sampling arguments."""

    prompt: dict[str, Any]  # {"prompt_token_ids": [...]} or {"prompt_embeds": tensor}
    prompt_tokens: int
    sampling: dict[str, Any]  # keyword arguments of vllm.SamplingParams


def plan(checked: text_intake.Checked) -> Plan:
    """vLLM's prompt and ``SamplingParams`` arguments for a checked request."""
    prompt, chosen = checked.prompt, checked.sampling
    sampling: dict[str, Any] = {
        "n": 1,
        "max_tokens": chosen.max_tokens,
        "temperature": chosen.temperature,
        "top_p": chosen.top_p,
        "stop": list(chosen.stop),
    }
    if chosen.top_k > 0:  # vLLM versions disagree on how "off" is spelled (0 or -1): leave it unset
        sampling["top_k"] = chosen.top_k
    if chosen.seed is not None:
        sampling["seed"] = chosen.seed
    if prompt.embeds is None:
        return Plan({"prompt_token_ids": list(prompt.token_ids)}, prompt.tokens, sampling)
    # vLLM ships the prompt to its engine-core process: a compact CPU copy.
    embeds = prompt.embeds.detach().cpu().contiguous()
    return Plan({EMBEDS: embeds}, prompt.tokens, sampling)


def finish_reason(reason: str | None, stop_reason: int | str | None) -> FinishReason:
    """vLLM's finish reason in the mesh's words (services/mesh/finish.py), mapped here
    alone. vLLM says "stop" for an end-of-sequence token (no ``stop_reason``) and for
    a stop string or stop token (its ``stop_reason``) alike; "length" as we do.
    Anything else ("abort", an "error" of newer versions, a reason still to come)
    ended the request short of its end without our asking: "abort"."""
    if reason == "stop":
        return "eos" if stop_reason is None else "stop"
    if reason == "length":
        return "length"
    return "abort"
