"""The transformers engine's text parts on the real SmolLM2 tokenizer: the
incremental detokenizer, stop strings, and sampling."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from services.engines.detokenizer import IncrementalDetokenizer
from services.engines.sampling import Sampling, sample
from services.engines.transformers.text import StopStrings


def test_detokenizer_never_splits_a_character(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Café 你好 🙂 naïve ok"
    ids = smollm2_tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some byte-level token ended mid-character and was held


def test_detokenizer_flush_shows_a_cut_character(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokenizer = smollm2_tokenizer
    ids = tokenizer("ok 你好")["input_ids"]  # 好 takes two byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer("Say:")["input_ids"])
    emitted = "".join(detok.add(i) for i in ids[:-1])
    assert emitted == "ok 你"
    assert detok.flush().endswith("\ufffd")


def test_stop_strings_hold_back_and_cut() -> None:
    stops = StopStrings(["STOP", "end."])
    assert stops.add("abc ST") == "abc "
    assert stops.add("AY S") == "STAY "
    assert stops.add("TO") == ""
    assert stops.add("P and more") == ""
    assert stops.stopped and stops.flush() == "" and stops.add("x") == ""

    earliest = StopStrings(["b", "a"])
    assert earliest.add("xxab") == "xx"

    tail = StopStrings(["end."])
    assert tail.add("the en") == "the "
    assert tail.flush() == "en"
    assert StopStrings([]).add("anything") == "anything"


def test_sampling_cuts_degenerate_to_greedy() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    for sampling in (Sampling(0.0, 1.0, 0), Sampling(1.0, 1.0, 1), Sampling(1.0, 0.01, 0)):
        assert {sample(logits, sampling, gen) for _ in range(20)} == {1}
    spread = {sample(logits, Sampling(1.0, 1.0, 2), gen) for _ in range(50)}
    assert spread == {1, 2}
