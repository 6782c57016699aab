"""The shell every scheduled engine runs in (scheduler/shell.py), with the counting
runner and no model: a request leaving its ``running`` block early is cancelled and
its rows freed, one that finished is not; a seed gives one stream; no scheduler
before ``start``."""

from __future__ import annotations

import pytest
import torch

from services.engines.scheduler import EngineShell, Limits
from tests.engines.scheduler.test_scheduler_alone import Counting, CountingRunner, finish, until


def test_leaving_the_block_early_cancels_the_request_and_frees_its_rows() -> None:
    shell: EngineShell[Counting] = EngineShell("counting", "cpu")
    with pytest.raises(RuntimeError, match=r"counting: call load\(\) first"):
        _ = shell.scheduler
    runner = CountingRunner()
    shell.start(runner, Limits(max_batch_size=4), "counting-steps")
    try:
        endless = Counting("endless", prompt=3, tokens=1_000_000)
        with shell.running(endless):
            until(lambda: len(endless.numbers) >= 3)  # the consumer stops reading here
        assert endless.cancelled
        until(lambda: "endless" in runner.freed)
        done = Counting("done", prompt=3, tokens=2)
        with shell.running(done):
            finish(done)
        assert done.numbers == [0, 1] and not done.cancelled
    finally:
        shell.close()
    with pytest.raises(RuntimeError, match="call load"):
        _ = shell.scheduler


def test_a_seed_gives_one_stream_and_none_a_fresh_one() -> None:
    shell: EngineShell[Counting] = EngineShell("counting", "cpu")

    def draw(seed: int | None) -> list[float]:
        return torch.rand(4, generator=shell.generator(seed)).tolist()

    assert draw(7) == draw(7) != draw(8)
    assert draw(None) != draw(None)
