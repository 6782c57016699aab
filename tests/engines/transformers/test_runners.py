"""The two runners compute what the model computes: the fast CPU runner (llama_cpu.py:
the lean forward and the decode stack) against the reference runner (transformers'
own forward), on tiny random decoders of each architecture it claims with their
linears on GGUF blocks of both kinds, and the reference copy holding the same
weights dequantised (tests/helpers/tiny_decoders.py).

A padded batch is prefilled, then decodes; the fast runner's error against a float64
run of the same weights may be no more than a small multiple of the reference's own
float32 error (tests/helpers/float_error.py), and the decided greedy choices are the
same. A mixed step (prefill and decode rows in one forward) gives what separate
forwards give, caches included.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from services.engines.kv_cache import KvCache, KvShape
from services.engines.transformers.runners import runner_for, runner_name
from services.engines.transformers.runners.llama_cpu import LlamaCpuRunner, llama_cpu_refuses
from services.engines.transformers.runners.reference import ReferenceRunner
from services.engines.transformers.runners.text_runner import TextRunner
from tests.helpers.float_error import assert_float32_close, assert_same_choices
from tests.helpers.tiny_decoders import CONFIGS, on_blocks, tiny

PROMPTS = [[5, 17, 99, 3, 64, 12, 7], [41, 8, 120, 33], [77]]  # left-padded to 7
STEPS = 5


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
    """Token ids and valid [rows, longest], left-padded as the caches take them."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        valid[row, width - len(prompt) :] = 1
    return ids, valid


def cache(model: PreTrainedModel, rows: int = 0) -> KvCache:
    return KvCache(KvShape.of(model.config, model.dtype, model.device), rows)


@torch.inference_mode()
def through(runner: TextRunner, prompts: list[list[int]], fed: torch.Tensor | None = None) -> Run:
    """Prefill ``prompts`` as one padded batch, then STEPS decode steps each feeding
    ``fed[:, step]`` (greedy choices where None)."""
    embed = runner.model.get_input_embeddings()
    kv = cache(runner.model, len(prompts))
    ids, valid = padded(prompts)
    run = Run()
    run.add(*runner.forward(kv, embed(ids), valid, True))
    for step in range(STEPS):
        token = run.logits[-1].argmax(-1) if fed is None else fed[:, step]
        one = torch.ones(len(prompts), 1, dtype=torch.long)
        run.add(*runner.forward(kv, embed(token[:, None]), one, True))
    return run


@torch.inference_mode()
def exact_run(model: PreTrainedModel, prompts: list[list[int]], fed: torch.Tensor) -> Run:
    """The float64 copy's logits and states, each row alone and unpadded, at the
    positions where the batched run chose its tokens."""
    exact = copy.deepcopy(model).double()
    logits, states = [], []
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([[*prompt, *fed[row, :STEPS].tolist()]])
        out = exact(input_ids=ids, output_hidden_states=True)
        logits.append(out.logits[0, len(prompt) - 1 :])
        states.append(out.hidden_states[-1][0, len(prompt) - 1 :])
    run = Run()
    run.logits, run.states = [torch.stack(logits)], [torch.stack(states)]
    return run


def pair(name: str, kind: str, **overrides: Any) -> tuple[LlamaCpuRunner, ReferenceRunner]:
    """The fast runner on a tiny model's blocks, the reference on its float copy."""
    model = tiny(name, **overrides)
    plain = on_blocks(model, kind)
    fast = runner_for(model, None)
    assert isinstance(fast, LlamaCpuRunner), llama_cpu_refuses(model)
    return fast, ReferenceRunner(plain, None)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_fast_runner_matches_the_reference_runner(name: str, kind: str) -> None:
    fast, reference = pair(name, kind)
    trusted = through(reference, PROMPTS)  # the reference chooses the tokens ...
    mine = through(fast, PROMPTS, trusted.tokens)  # ... both read the same ones
    assert fast.stack_steps == STEPS  # every decode step ran the stack
    exact = exact_run(reference.model, PROMPTS, trusted.tokens)
    (mine_logits, mine_states), (plain_logits, plain_states) = mine.stacked(), trusted.stacked()
    assert_float32_close(mine_logits, plain_logits, exact.logits[0])
    assert_float32_close(mine_states, plain_states, exact.states[0])
    assert_same_choices(mine_logits, plain_logits, exact.logits[0])
    assert torch.equal(mine.tokens, trusted.tokens)


def test_a_wrong_weight_fails_the_same_check() -> None:
    """The checks above can fail: one block of one layer's down projection off by one
    quantisation step in the fast runner only."""
    fast, reference = pair("llama", "q4_1")
    down = fast.model.model.layers[1].mlp.down_proj
    down.qs[3, 1] ^= 0x11
    trusted = through(reference, PROMPTS)
    mine = through(fast, PROMPTS, trusted.tokens)
    exact = exact_run(reference.model, PROMPTS, trusted.tokens)
    with pytest.raises(AssertionError):
        assert_float32_close(mine.stacked()[0], trusted.stacked()[0], exact.logits[0])


# -- the mixed step ------------------------------------------------------------------

DECODING = [[5, 17, 99, 3, 64], [41, 8]]  # prefilled before the mixed step
ARRIVING = [[77, 12, 9, 30], [100]]  # prefilled in it
AFTER = 3  # decode steps of all four rows after it
FED = torch.randint(1, 128, (4, AFTER + 1), generator=torch.Generator().manual_seed(1))


@torch.inference_mode()
def mixed_then_decode(runner: TextRunner, mixed: bool) -> Run:
    """DECODING prefilled, then one step that decodes them (feeding FED[:2, 0]) and
    prefills ARRIVING, in one mixed forward or as two forwards; then the arrivals join
    the decoding rows (as the runner does) for AFTER decode steps. Rows in the order
    decoding, arriving."""
    embed = runner.model.get_input_embeddings()
    running, arriving = cache(runner.model, len(DECODING)), cache(runner.model, len(ARRIVING))
    ids, valid = padded(DECODING)
    runner.forward(running, embed(ids), valid, False)
    ids, valid = padded(ARRIVING)
    decode = embed(FED[:2, :1])
    if mixed:
        logits, states = runner.mixed_forward(
            (arriving, embed(ids), valid), (running, decode), True
        )
        assert states is not None
        order = [2, 3, 0, 1]  # a mixed forward answers the prefill rows first
        logits, states = logits[order], states[order]
    else:
        logits_d, states_d = runner.forward(
            running, decode, torch.ones(2, 1, dtype=torch.long), True
        )
        logits_p, states_p = runner.forward(arriving, embed(ids), valid, True)
        assert states_d is not None and states_p is not None
        logits, states = torch.cat([logits_d, logits_p]), torch.cat([states_d, states_p])
    running.concat(arriving)
    run = Run()
    run.add(logits, states)
    columns = torch.cat([FED[:2, 1:], FED[2:, :AFTER]])  # each row's next inputs
    for step in range(AFTER):
        token = embed(columns[:, step : step + 1])
        run.add(*runner.forward(running, token, torch.ones(4, 1, dtype=torch.long), True))
    return run


@torch.inference_mode()
def exact_mixed(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 copy's logits and states at the positions ``mixed_then_decode``
    answers: each row's last AFTER + 1, each row alone."""
    exact = copy.deepcopy(model).double()
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
def test_a_mixed_step_equals_separate_prefill_and_decode(name: str) -> None:
    """Attention per part inside one forward: the rows it prefilled and the rows it
    decoded get what separate forwards give them, and so do the caches it wrote (the
    decode steps after it read them)."""
    fast, reference = pair(name, "q8_0")
    mine = mixed_then_decode(fast, mixed=True).stacked()
    separate = mixed_then_decode(fast, mixed=False).stacked()
    trusted = mixed_then_decode(reference, mixed=False).stacked()
    exact_logits, exact_states = exact_mixed(reference.model)
    assert_float32_close(mine[0], trusted[0], exact_logits)
    assert_float32_close(mine[1], trusted[1], exact_states)
    assert_float32_close(separate[0], trusted[0], exact_logits)
    assert_same_choices(mine[0], trusted[0], exact_logits)
    assert torch.equal(mine[0].argmax(-1), separate[0].argmax(-1))


# -- which runner runs a model -------------------------------------------------------

REFUSED: dict[str, tuple[str, dict[str, Any], bool, str]] = {
    "gelu": ("llama", {"hidden_act": "gelu"}, True, "its activation is gelu, not silu"),
    "eager": ("llama", {"_attn_implementation": "eager"}, True, "runs eager attention, not SDPA"),
    "mistral window": ("mistral", {"sliding_window": 4}, True, "sliding-window layers"),
    "float linears": ("llama", {}, False, "layer 0's q_proj is not on GGUF blocks"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_where_the_fast_runner_does_not_apply_it_says_why_and_the_reference_runs(
    case: str,
) -> None:
    name, overrides, blocks, reason = REFUSED[case]
    model = tiny(name, **overrides)
    if blocks:
        on_blocks(model)
    why = llama_cpu_refuses(model)
    assert why is not None and reason in why
    if "window" in case:
        return  # the reference refuses it too: a sliding window cannot be batched
    runner = runner_for(model, None)
    assert runner_name(runner) == "reference"
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    run = through(runner, PROMPTS)
    assert len(calls) == STEPS + 1  # the model's own forward, each step
    assert run.tokens.shape == (len(PROMPTS), STEPS + 1)


def test_the_reference_runner_can_be_asked_for() -> None:
    model = tiny("llama")
    on_blocks(model)
    assert runner_name(runner_for(model, None)) == "llama_cpu"
    assert runner_name(runner_for(model, None, "reference")) == "reference"
