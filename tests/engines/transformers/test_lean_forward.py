"""The lean forward (lean_forward.py) computes what the model's own forward computes.

Tiny random decoders of each architecture it claims (Llama, Qwen2 with q/k/v biases,
Qwen3 with per-head q/k norms, Mistral without a window) run a padded batch through
KvRows, the engine's cache, once lean and once through transformers' forward (a deep
copy with ``keep_transformers_forward``): the lean error against a float64 run of the
same weights may be no more than a small multiple of transformers' own float32 error
(tests/helpers/float_error.py), and the decided greedy choices are the same. The
real SmolLM2 on its GGUF blocks checks the fused weights and the engine's tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from services.engines.transformers import mixed_step
from services.engines.transformers.kv_rows import KvRows
from services.engines.transformers.lean_forward import (
    keep_transformers_forward,
    lean_applies,
    lean_of,
)
from tests.helpers.float_error import assert_float32_close, assert_same_choices

SHAPE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attn_implementation": "sdpa",
}

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen2": lambda: Qwen2Config(**SHAPE),  # q, k and v have biases
    "qwen3": lambda: Qwen3Config(**SHAPE),  # per-head q and k norms
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=None),
}
PROMPTS = [[5, 17, 99, 3, 64, 12, 7], [41, 8, 120, 33], [77]]  # left-padded to 7
STEPS = 5


def tiny(name: str, **overrides: Any) -> PreTrainedModel:
    """A tiny random model whose every part matters: the init leaves biases at zero
    and norm weights at one, which would let a dropped bias or norm weight pass."""
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
            elif "RMSNorm" in type(module).__name__:
                module.weight.normal_(1, 0.3)
    return model


class Run:
    """Logits and last hidden states [rows, steps + 1, ...] of a prefill and decode steps."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, states: torch.Tensor | None) -> None:
        assert states is not None
        self.logits.append(logits)
        self.states.append(states)

    @property
    def tokens(self) -> torch.Tensor:
        return torch.stack(self.logits, dim=1).argmax(-1)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.logits, dim=1), torch.stack(self.states, dim=1)


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and valid [rows, longest], left-padded as KvRows expects."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        valid[row, width - len(prompt) :] = 1
    return ids, valid


@torch.inference_mode()
def through_kv_rows(
    model: PreTrainedModel, prompts: list[list[int]], fed: torch.Tensor | None = None
) -> Run:
    """Prefill ``prompts`` as one padded batch, then STEPS decode steps each feeding
    ``fed[:, step]`` (greedy choices where None)."""
    embed = model.get_input_embeddings()
    kv = KvRows(model)
    kv.add_rows(len(prompts))
    ids, valid = padded(prompts)
    run = Run()
    run.add(*kv.forward(embed(ids), valid, True))
    for step in range(STEPS):
        token = run.logits[-1].argmax(-1) if fed is None else fed[:, step]
        run.add(
            *kv.forward(embed(token[:, None]), torch.ones(len(prompts), 1, dtype=torch.long), True)
        )
    return run


@torch.inference_mode()
def exact_run(model: PreTrainedModel, prompts: list[list[int]], fed: torch.Tensor) -> Run:
    """The float64 copy's logits and states, each row alone and unpadded, at the
    positions where the batched run chose its tokens."""
    exact = copy.deepcopy(model).double()
    keep_transformers_forward(exact)
    logits, states = [], []
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([[*prompt, *fed[row, :STEPS].tolist()]])
        out = exact(input_ids=ids, output_hidden_states=True)
        logits.append(out.logits[0, len(prompt) - 1 :])
        states.append(out.hidden_states[-1][0, len(prompt) - 1 :])
    run = Run()
    run.logits, run.states = [torch.stack(logits)], [torch.stack(states)]
    return run


def transformers_copy(model: PreTrainedModel) -> tuple[PreTrainedModel, list[int]]:
    """A deep copy that runs its own forward, and a list counting its forward calls."""
    plain = copy.deepcopy(model)
    keep_transformers_forward(plain)
    calls: list[int] = []
    plain.register_forward_pre_hook(lambda *_: calls.append(1))
    return plain, calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lean_matches_transformers_forward_through_kv_rows(name: str) -> None:
    model = tiny(name)
    plain, plain_calls = transformers_copy(model)
    lean_calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: lean_calls.append(1))

    trusted = through_kv_rows(plain, PROMPTS)  # transformers' forward chooses the tokens ...
    fed = trusted.tokens
    mine = through_kv_rows(model, PROMPTS, fed)  # ... both read the same ones
    assert lean_of(model) is not None and lean_of(plain) is None
    assert plain_calls and not lean_calls  # each path ran where it was meant to
    reference = exact_run(model, PROMPTS, fed)
    (mine_logits, mine_states), (plain_logits, plain_states) = mine.stacked(), trusted.stacked()
    exact_logits, exact_states = reference.logits[0], reference.states[0]
    assert_float32_close(mine_logits, plain_logits, exact_logits)
    assert_float32_close(mine_states, plain_states, exact_states)
    assert_same_choices(mine_logits, plain_logits, exact_logits)
    assert torch.equal(mine.tokens, trusted.tokens)


# -- the mixed step ------------------------------------------------------------------

DECODING = [[5, 17, 99, 3, 64], [41, 8]]  # prefilled before the mixed step
ARRIVING = [[77, 12, 9, 30], [100]]  # prefilled in it
AFTER = 3  # decode steps of all four rows after it
FED = torch.randint(1, 128, (4, AFTER + 1), generator=torch.Generator().manual_seed(1))


@torch.inference_mode()
def mixed_then_decode(model: PreTrainedModel, mixed: bool) -> Run:
    """DECODING prefilled, then one step that decodes them (feeding FED[:2, 0]) and
    prefills ARRIVING, in one mixed forward or as two forwards; then the arrivals
    join the running rows (as the step loop does) for AFTER decode steps. Rows in
    the order decoding, arriving."""
    embed = model.get_input_embeddings()
    running, arriving = KvRows(model), KvRows(model)
    running.add_rows(len(DECODING))
    arriving.add_rows(len(ARRIVING))
    ids, valid = padded(DECODING)
    running.forward(embed(ids), valid, False)
    ids, valid = padded(ARRIVING)
    decode = embed(FED[:2, :1])
    if mixed:
        logits, states = mixed_step.mixed_forward(
            model, (arriving, embed(ids), valid), (running, decode), True
        )
        assert states is not None
        order = [2, 3, 0, 1]  # mixed_forward answers the prefill rows first
        logits, states = logits[order], states[order]
    else:
        logits_d, states_d = running.forward(decode, torch.ones(2, 1, dtype=torch.long), True)
        logits_p, states_p = arriving.forward(embed(ids), valid, True)
        assert states_d is not None and states_p is not None
        logits, states = torch.cat([logits_d, logits_p]), torch.cat([states_d, states_p])
    running.concat(arriving)
    run = Run()
    run.add(logits, states)
    columns = torch.cat([FED[:2, 1:], FED[2:, :AFTER]])  # each row's next inputs
    for step in range(AFTER):
        token = embed(columns[:, step : step + 1])
        run.add(*running.forward(token, torch.ones(4, 1, dtype=torch.long), True))
    return run


@torch.inference_mode()
def exact_mixed(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 copy's logits and states at the positions ``mixed_then_decode``
    answers: each row's last AFTER + 1, each row alone."""
    exact = copy.deepcopy(model).double()
    keep_transformers_forward(exact)
    sequences = [
        *(p + FED[row, : AFTER + 1].tolist() for row, p in enumerate(DECODING)),
        *(p + FED[row + 2, :AFTER].tolist() for row, p in enumerate(ARRIVING)),
    ]
    logits, states = [], []
    for sequence in sequences:
        out = exact(input_ids=torch.tensor([sequence]), output_hidden_states=True)
        logits.append(out.logits[0, -(AFTER + 1) :])
        states.append(out.hidden_states[-1][0, -(AFTER + 1) :])
    return torch.stack(logits), torch.stack(states)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_lean_mixed_step_equals_separate_prefill_and_decode(name: str) -> None:
    """Attention per part inside the lean forward: the rows it prefilled and the rows
    it decoded get what separate forwards give them, and so do the caches it wrote
    (the decode steps after it read them)."""
    model = tiny(name)
    assert mixed_step.enable(model)  # as the step loop does
    plain, _ = transformers_copy(model)
    mine = mixed_then_decode(model, mixed=True).stacked()
    lean_separate = mixed_then_decode(model, mixed=False).stacked()
    trusted = mixed_then_decode(plain, mixed=False).stacked()
    assert lean_of(model) is not None
    exact_logits, exact_states = exact_mixed(model)
    assert_float32_close(mine[0], trusted[0], exact_logits)
    assert_float32_close(mine[1], trusted[1], exact_states)
    assert_float32_close(lean_separate[0], trusted[0], exact_logits)
    assert_same_choices(mine[0], trusted[0], exact_logits)
    assert torch.equal(mine[0].argmax(-1), lean_separate[0].argmax(-1))


# -- where it does not apply ----------------------------------------------------------

REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "gelu": ("llama", {"hidden_act": "gelu"}, "its activation is gelu, not silu"),
    "eager": ("llama", {"_attn_implementation": "eager"}, "runs eager attention, not SDPA"),
    "mistral window": ("mistral", {"sliding_window": 4}, "sliding-window layers"),
    "qwen2 window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention"] * 2},
        "sliding-window layers",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_lean_applies_says_why_not(case: str) -> None:
    name, overrides, reason = REFUSED[case]
    model = tiny(name, **overrides)
    why = lean_applies(model)
    assert why is not None and reason in why
    assert lean_of(model) is None
    assert lean_applies(tiny(name)) is None  # the same architecture without it applies


@pytest.mark.parametrize("case", ["gelu", "eager"])
def test_a_refused_model_runs_its_own_forward_through_kv_rows(case: str) -> None:
    """KvRows falls back to the model's forward: the same numbers as a copy told to
    keep it, and the model's forward is what ran."""
    name, overrides, _reason = REFUSED[case]
    model = tiny(name, **overrides)
    plain, _ = transformers_copy(model)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    mine = through_kv_rows(model, PROMPTS)
    assert len(calls) == STEPS + 1
    trusted = through_kv_rows(plain, PROMPTS, mine.tokens)
    assert torch.equal(mine.stacked()[0], trusted.stacked()[0])
    reference = exact_run(model, PROMPTS, mine.tokens)
    assert_same_choices(mine.stacked()[0], trusted.stacked()[0], reference.logits[0])
