"""The thinker and the talker end a request in the mesh's words (services/mesh/finish.py):
``eos`` when the token their config names the end comes, ``length`` at max_tokens,
as the text engines say it. The tiny random thinker never draws its real end token
in its few tokens, so its end is renamed to a token the run is known to draw."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engines.base import EngineRequest, FinishOutput, SamplingParams, TensorOutput
from services.engines.qwen_omni import QwenOmniTalker, QwenOmniThinker
from services.testing import engine_runs
from services.testing.engine_runs import collect, generate, tokens_of
from tests.engines.qwen_omni import parts
from tests.engines.qwen_omni.reference import TALKER_TOKENS, THINKER_TOKENS, request


@pytest.fixture(scope="module")
def pair(tiny_omni: Path) -> Iterator[tuple[QwenOmniThinker, QwenOmniTalker]]:
    thinker, talker = parts.thinker(tiny_omni), parts.talker(tiny_omni)
    yield thinker, talker
    thinker.close()
    talker.close()


def _first_new(ids: list[int], at_least: int) -> int:
    """The first index >= ``at_least`` whose id did not come before it."""
    return next(i for i in range(at_least, len(ids)) if ids[i] not in ids[:i])


async def test_the_thinker_says_eos_at_its_end_token_and_length_at_max_tokens(pair) -> None:
    thinker, _ = pair
    events = await collect(generate(thinker, request("text", "whole")))
    ids, finish = tokens_of(events), events[-1]
    end = thinker._config.im_end_token_id
    assert isinstance(finish, FinishOutput)
    assert finish.reason == ("eos" if ids[-1] == end else "length")
    assert len(ids) == THINKER_TOKENS and end not in ids  # the tiny model runs to the cap
    cut = _first_new(ids, 2)
    thinker._config.im_end_token_id = ids[cut]
    try:
        events = await collect(generate(thinker, request("text", "ended")))
    finally:
        thinker._config.im_end_token_id = end
    assert tokens_of(events) == ids[: cut + 1]
    assert events[-1] == FinishOutput("eos", finish.prompt_tokens, cut + 1)


async def _talk(
    talker: QwenOmniTalker, thought: parts.Thought, rid: str, **params: int
) -> tuple[torch.Tensor, object]:
    """The codes of the whole hand-off spoken, and the last event."""
    window = EngineRequest(
        rid, token_ids=tuple(thought.answer_ids), tensors=dict(thought.handoff),
        params=SamplingParams(**params),
    )  # fmt: skip
    plan = engine_runs.plan(talker, window)
    end = talker.input_ended(rid)
    assert end is not None
    events = await collect(talker.generate(plan)) + await collect(talker.generate(end))
    talker.release(rid)
    codes = torch.cat([e.tensors["codes"] for e in events if isinstance(e, TensorOutput)])
    return codes, events[-1]


async def test_the_talker_says_eos_at_its_codec_end_and_length_at_max_tokens(pair) -> None:
    thinker, talker = pair
    thought = await parts.think(thinker, request("text", "spoken"))
    codes, finish = await _talk(talker, thought, "whole")
    assert isinstance(finish, FinishOutput)
    # The tiny talker draws its codec end before the cap. Each step's codes go out
    # with the next step: the end token drawn last has none.
    assert finish == FinishOutput("eos", finish.prompt_tokens, len(codes))
    assert 4 < len(codes) < TALKER_TOKENS - 1
    short = len(codes) // 2
    cut, finish = await _talk(talker, thought, "cut", max_tokens=short)
    assert finish == FinishOutput("length", finish.prompt_tokens, short - 1)
    assert torch.equal(cut, codes[: short - 1])
