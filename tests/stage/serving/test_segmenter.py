from __future__ import annotations

import pytest
import torch

from services.engines.base import Blob, TensorOutput, TokenOutput
from services.stage.serving.segmenter import Segmenter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tok(i: int, text: str = "x", hidden: bool = False) -> TokenOutput:
    return TokenOutput((i,), text, torch.full((1, 4), float(i)) if hidden else None)


def test_flushes_at_max_tokens_with_increasing_sequence() -> None:
    seg = Segmenter(max_tokens=3, min_interval_s=10.0, clock=Clock())
    due = [seg.add(tok(i)) for i in range(3)]
    assert due == [False, False, True]
    first = seg.flush()
    assert first is not None and first.token_ids == (0, 1, 2) and first.sequence == 0
    assert seg.add(tok(3)) is False
    last = seg.flush(is_last=True)
    assert last is not None and last.sequence == 1 and last.is_last and last.token_ids == (3,)


def test_time_based_flush_counts_from_the_last_flush() -> None:
    clock = Clock()
    seg = Segmenter(max_tokens=100, min_interval_s=0.05, clock=clock)
    assert seg.due_in() is None  # nothing pending
    seg.add(tok(1))
    assert seg.due_in() == pytest.approx(0.05)
    clock.now += 0.03
    assert seg.due_in() == pytest.approx(0.02)
    clock.now += 0.02
    assert seg.add(tok(2)) is True
    seg.flush()
    seg.add(tok(3))
    assert seg.due_in() == pytest.approx(0.05)  # the clock restarted at the flush


def test_last_segment_exists_even_with_nothing_pending() -> None:
    seg = Segmenter(max_tokens=1, min_interval_s=1.0, clock=Clock())
    assert seg.flush() is None
    last = seg.flush(is_last=True)
    assert last is not None and last.is_last and last.token_ids == () and last.sequence == 0


def test_hidden_states_are_joined_per_segment_and_outputs_ride_along() -> None:
    seg = Segmenter(max_tokens=2, min_interval_s=1.0, clock=Clock())
    seg.add(tok(1, "a", hidden=True))
    seg.add(tok(2, "b", hidden=True))
    seg.add_outputs(
        TensorOutput({"image": torch.zeros(2, 2, 3)}, (Blob("image", "image/png", b"p"),))
    )
    out = seg.flush(is_last=True)
    assert out is not None
    assert out.text == "ab"
    assert out.tensors["hidden_states"].tolist() == [[1.0] * 4, [2.0] * 4]
    assert out.tensors["image"].shape == (2, 2, 3)
    assert out.blobs[0].data == b"p"


def test_the_first_tokens_leave_at_once_and_later_ones_batch() -> None:
    clock = Clock()
    seg = Segmenter(max_tokens=4, min_interval_s=10.0, clock=clock, first_tokens=1)
    assert seg.add(tok(0)) is True  # no wait for the first token
    first = seg.flush()
    assert first is not None and first.token_ids == (0,) and first.sequence == 0
    assert [seg.add(tok(i)) for i in range(1, 5)] == [False, False, False, True]
    second = seg.flush()
    assert second is not None and second.token_ids == (1, 2, 3, 4)
    seg.add(tok(5))
    assert seg.due_in() == pytest.approx(10.0)  # the interval rule is back for the rest


def test_a_tensor_only_segment_does_not_count_as_the_first_tokens() -> None:
    seg = Segmenter(max_tokens=4, min_interval_s=10.0, clock=Clock(), first_tokens=2)
    seg.add_outputs(TensorOutput({"image": torch.zeros(1)}, ()))
    assert seg.flush() is not None  # sequence 0 carries no tokens
    assert seg.add(tok(0)) is False
    assert seg.add(tok(1)) is True  # first_tokens still applies
    out = seg.flush()
    assert out is not None and out.sequence == 1 and out.token_ids == (0, 1)


def test_first_tokens_above_the_maximum_is_the_maximum() -> None:
    seg = Segmenter(max_tokens=2, min_interval_s=10.0, clock=Clock(), first_tokens=5)
    assert [seg.add(tok(i)) for i in range(2)] == [False, True]
