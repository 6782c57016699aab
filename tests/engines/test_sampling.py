"""greedy_tokens is torch's argmax row by row, where the two could part: equal maxima
(the first wins), NaN (it wins), infinities, and a bfloat16 row numpy cannot hold."""

from __future__ import annotations

import torch

from services.engines.sampling import greedy_tokens


def test_greedy_tokens_are_torchs_argmax_in_every_corner() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=g)
    logits[1, [7, 300, 40000]] = 99.0  # equal maxima: the first
    logits[2, 123] = float("nan")  # NaN: argmax's pick
    logits[3, 5] = float("inf")
    logits[4] = float("-inf")  # nothing above -inf: index 0
    logits[5, 49151] = 50.0  # the last column
    expected = logits.argmax(dim=-1).tolist()
    assert expected[1] == 7 and expected[5] == 49151  # the cases are what they say
    assert greedy_tokens(logits) == expected
    assert greedy_tokens(logits[2:4]) == expected[2:4]  # a slice of rows
    halves = logits.to(torch.bfloat16)
    assert greedy_tokens(halves) == halves.argmax(dim=-1).tolist()
