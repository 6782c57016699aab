"""Time to first token under the scheduler, by order of events (never by wall time):
a request's first token is handed over before the model runs anything else, an idle
scheduler waits for company only when some is on its way, and what a watcher sees
is what ran.

A scheduler of its own runs the tiny random-weight Llama (the reference runner);
every forward it runs (seen where it makes logits: the output projection, which
every forward calls as a module) and every delivery it makes are recorded in one
list, in the order they happened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from services.engines.base import EngineRequest, EngineSettings, SamplingParams, TokenOutput
from services.engines.scheduler import Delivery, Limits, Scheduler, StepTaken
from services.engines.transformers import TransformersEngine
from services.engines.transformers.runners import runner_for
from services.engines.transformers.text_request import TextRequest
from services.testing.configs import TINY_LLAMA

# Far longer than any test here takes: a scheduler that waited this long would fail it.
LONG_GATHER_S = 120.0


@pytest.fixture(scope="module")
def tiny(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[TransformersEngine]:
    torch.manual_seed(0)
    settings = EngineSettings(
        load_format="dummy",
        cache_dir=omni_cache_dir,
        engine_args={"config_overrides": TINY_LLAMA},
    )
    engine = TransformersEngine(settings)
    engine.load(smollm2_gguf)
    yield engine
    engine.close()


class Log:
    """What the model thread did, in order: ("forward", requests in it) and
    ("deliver", request id, tokens in the delivery)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.entries: list[tuple[str, Any, int]] = []
        self.done: dict[str, threading.Event] = {}
        head = model.get_output_embeddings()
        assert isinstance(head, torch.nn.Module)
        self._handle = head.register_forward_pre_hook(self._forward)

    def _forward(self, _module: Any, args: tuple[torch.Tensor, ...]) -> None:
        # One row of logits per request in the forward (the last position of each).
        self.entries.append(("forward", "rows", args[0].shape[:-1].numel()))

    def request(self, engine: TransformersEngine, rid: str, max_tokens: int) -> TextRequest:
        request = EngineRequest(
            rid, token_ids=(5, 6, 7, 8), params=SamplingParams(max_tokens=max_tokens)
        )
        self.done[rid] = threading.Event()

        def deliver(delivery: Delivery) -> None:
            assert not isinstance(delivery, BaseException), delivery
            tokens = sum(len(e.token_ids) for e in delivery if isinstance(e, TokenOutput))
            self.entries.append(("deliver", rid, tokens))
            if any(not isinstance(e, TokenOutput) for e in delivery):  # its FinishOutput
                self.done[rid].set()

        return TextRequest(
            request_id=rid,
            plan=engine.check(request).resolved,
            tokenizer=engine.tokenizer,
            generator=torch.Generator(),
            deliver=deliver,
            submitted=time.monotonic(),
            eos_ids=frozenset(),
        )

    def wait(self, rid: str) -> None:
        assert self.done[rid].wait(60), f"{rid} did not finish: {self.entries}"

    def close(self) -> None:
        self._handle.remove()


@pytest.fixture
def log(tiny: TransformersEngine) -> Iterator[Log]:
    recorder = Log(tiny.model)
    yield recorder
    recorder.close()


def loop_of(engine: TransformersEngine, gather_s: float = 0.0) -> Scheduler[TextRequest]:
    limits = Limits(max_batch_size=4, prefill_tokens=64, gather_s=gather_s)
    return Scheduler(runner_for(engine.model, None), limits)


def test_the_first_token_is_delivered_before_the_next_forward(
    tiny: TransformersEngine, log: Log
) -> None:
    loop = loop_of(tiny)
    try:
        loop.submit(log.request(tiny, "a", max_tokens=3))
        log.wait("a")
    finally:
        loop.close()
    # The prefill forward, then its one token handed over alone, then the decodes.
    assert log.entries[:3] == [
        ("forward", "rows", 1),
        ("deliver", "a", 1),
        ("forward", "rows", 1),
    ], log.entries
    assert [e for e in log.entries if e[0] == "deliver"] == [("deliver", "a", 1)] * 3


def test_a_lone_request_does_not_wait_to_gather(tiny: TransformersEngine, log: Log) -> None:
    loop = loop_of(tiny, gather_s=LONG_GATHER_S)
    try:
        loop.submit(log.request(tiny, "alone", max_tokens=2))
        log.wait("alone")  # 60 s at most, against a gather window of 120 s
    finally:
        loop.close()


def test_requests_on_their_way_are_gathered_into_one_prefill(
    tiny: TransformersEngine, log: Log
) -> None:
    loop = loop_of(tiny, gather_s=LONG_GATHER_S)
    try:
        loop.expect()  # two requests checked, as a stage checks each before it runs it
        loop.expect()
        loop.submit(log.request(tiny, "first", max_tokens=2))
        time.sleep(0.2)  # the second is late, but announced: the scheduler waits for it
        loop.submit(log.request(tiny, "second", max_tokens=2))
        log.wait("first")
        log.wait("second")
    finally:
        loop.close()
    assert log.entries[0] == ("forward", "rows", 2), log.entries  # one prefill of both


def test_an_announced_request_that_never_comes_is_not_waited_for_long(
    tiny: TransformersEngine, log: Log
) -> None:
    loop = loop_of(tiny, gather_s=0.05)
    try:
        loop.expect()
        loop.expect()  # refused after its check, say: it never arrives
        loop.submit(log.request(tiny, "only", max_tokens=2))
        log.wait("only")
    finally:
        loop.close()
    assert log.entries[0] == ("forward", "rows", 1), log.entries


def test_a_watcher_sees_each_forward_and_what_it_ran(tiny: TransformersEngine, log: Log) -> None:
    loop = loop_of(tiny, gather_s=LONG_GATHER_S)
    taken: list[StepTaken] = []
    stop = loop.watch(taken.append)
    try:
        loop.expect()
        loop.expect()
        loop.submit(log.request(tiny, "one", max_tokens=3))
        loop.submit(log.request(tiny, "two", max_tokens=2))
        log.wait("one")
        log.wait("two")
    finally:
        stop()
        loop.close()
    forwards = [e[2] for e in log.entries if e[0] == "forward"]
    assert [len(t.prefill) + len(t.decode) for t in taken] == forwards
    assert taken[0] == StepTaken(("one", "two"), 4, ())  # one prefill of both 4-token prompts
    assert [t.decode for t in taken[1:]] == [("one", "two"), ("one",)]
