"""Qwen3-Omni at concurrency, engine level, on the tiny checkpoint: requests batched in
all three engines give what they give alone (by the rule in concurrency.py), at 1, 4,
8 and 16 at once; a corrupted hand-off fails that rule; the streamed thinker -> talker
edge gives exactly the codes of the whole hand-off; a talker ahead of its thinker
waits without stepping; a request cancelled mid-answer leaves all three engines'
rows at once and the others unchanged."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engines.base import EngineRequest, SamplingParams, TensorOutput, TokenOutput
from services.engines.scheduler import StepTaken
from services.testing import engine_runs
from services.testing.engine_runs import collect, generate
from tests.engines.qwen_omni import parts
from tests.engines.qwen_omni.concurrency import (
    COUNTS,
    Engines,
    Spoken,
    assert_as_alone,
    decided,
    omni_request,
)
from tests.helpers.polling import eventually


@pytest.mark.parametrize("count", COUNTS)
async def test_batched_requests_give_what_they_give_alone(
    engines: Engines, alone: tuple[list[Spoken], list[Spoken]], count: int
) -> None:
    taken: list[StepTaken] = []
    stop = engines.talker.scheduler.watch(taken.append)
    runners = (engines.thinker.scheduler.runner, engines.talker.scheduler.runner)
    for runner in runners:
        runner.prefills.clear()
    try:
        batched = await engines.many(count, f"n{count}-")
    finally:
        stop()
    trusted, reference = alone
    same = [assert_as_alone(batched[i], trusted[i], reference[i]) for i in range(count)]
    # Where no choice is near a tie (float32 alone and float64 agree all the way), a
    # batched request must be its alone self: the same ids and codes, the audio by the
    # rule; most of these requests are so (the check is not vacuous).
    sure = [i for i in range(count) if decided(trusted[i], reference[i])]
    assert len(sure) >= 0.75 * count, sure
    assert all(same[i] for i in sure), (same, sure)
    assert all(len(s.codes) and s.ids for s in batched)
    assert sum(len(s.codes) for s in batched) > 20 * count  # not vacuous: long answers
    if count > 1:  # they did share forwards, in the talker as in the others
        assert max(len(t.decode) for t in taken) > 1, taken
    if count >= 8:  # and prompts of text alone (one in three) prefilled together
        for runner in runners:
            assert max(runner.prefills) > 1, (type(runner).__name__, runner.prefills)


async def test_a_corrupted_handoff_fails_the_rule(
    engines: Engines, alone: tuple[list[Spoken], list[Spoken]]
) -> None:
    """The rule can fail: the talker given the thinker's prompt part one part in a
    thousand off."""
    trusted, reference = alone
    thought = await parts.think(engines.thinker, omni_request(0, "bent"))
    thought.handoff["prompt_hidden_states"] = thought.handoff["prompt_hidden_states"] * 1.001
    codes = await parts.talk(engines.talker, thought, "bent", windows=2)
    bent = Spoken(thought.answer_ids, codes, [], dict(engines.rows.pop("bent")))
    bent.logits["text"] = trusted[0].logits["text"]  # the thinker's part was not touched
    with pytest.raises(AssertionError):
        assert_as_alone(bent, trusted[0], reference[0])


@pytest.mark.parametrize("window", [1, 2, 5])
async def test_the_streamed_edge_gives_the_codes_of_the_whole_handoff(
    engines: Engines, window: int
) -> None:
    for index in range(3):  # text, image, audio
        thought = await parts.think(engines.thinker, omni_request(index, f"w{window}-{index}"))
        whole = await parts.talk(engines.talker, thought, f"whole{window}-{index}", windows=0)
        streamed = await parts.talk(engines.talker, thought, f"s{window}-{index}", windows=window)
        assert torch.equal(streamed, whole), (window, index)
    engines.rows.clear()


async def test_a_talker_ahead_of_its_thinker_waits_without_stepping(engines: Engines) -> None:
    thought = await parts.think(engines.thinker, omni_request(1, "slow"))
    talker, ids, rows = engines.talker, thought.answer_ids, thought.handoff["hidden_states"]
    first = EngineRequest("slow", token_ids=tuple(ids[:3]),
                          tensors={**thought.handoff, "hidden_states": rows[:3]},
                          params=SamplingParams())  # fmt: skip
    taken: list[StepTaken] = []
    stop = talker.scheduler.watch(taken.append)
    try:
        early = await collect(
            talker.generate(engine_runs.plan(talker, first))
        )  # prefill and one step
        stepped = len(taken)
        await asyncio.sleep(0.3)
        assert len(taken) == stepped, "the talker stepped without its next row"
        more = {"hidden_states": rows[3:]}
        rest = EngineRequest(
            "slow", token_ids=tuple(ids[3:]), tensors=more, params=SamplingParams()
        )
        checked = talker.check(rest)  # checking only checks: no rows reach the talker
        await asyncio.sleep(0.3)
        assert len(taken) == stepped, "the talker stepped on a window only checked"
        talker.take(checked)  # as the stage hands it over (capabilities.planned)
        later = await collect(talker.generate(checked))
        final = talker.input_ended("slow")
        assert final is not None
        last = await collect(talker.generate(final))
    finally:
        stop()
        talker.release("slow")
    codes = [e.tensors["codes"] for e in [*early, *later, *last] if isinstance(e, TensorOutput)]
    whole = await parts.talk(talker, thought, "slow-whole", windows=0)
    assert torch.equal(torch.cat(codes), whole)
    assert len([e for e in early if isinstance(e, TensorOutput)]) == 1  # step 0 needs token 2
    engines.rows.clear()


async def test_a_cancelled_request_leaves_every_engines_rows(
    engines: Engines, alone: tuple[list[Spoken], list[Spoken]]
) -> None:
    """Four requests at once through the three engines; one is closed in the middle
    of its answer (as a stage closes a cancelled request's generate): its rows leave
    the thinker, and its talker and code2wav state go at its release; the other three
    give what they give alone."""
    trusted, reference = alone
    keep = [asyncio.create_task(engines.speak(i, f"k{i}")) for i in range(1, 4)]
    thinker = engines.thinker
    victim = generate(thinker, omni_request(0, "victim"))
    tokens = 0
    async for event in victim:
        tokens += isinstance(event, TokenOutput) and bool(event.token_ids)
        if tokens == 3:
            break
    await victim.aclose()
    engines.talker.release("victim")  # the stage releases what a request kept, on every path
    engines.code2wav.release("victim")
    rows = thinker.scheduler.runner.rows
    await eventually(
        lambda: all(r.request_id != "victim" for r in rows.requests),
        10,
        message="the cancelled request kept its thinker row",
    )
    kept = await asyncio.gather(*keep)
    for offset, spoken in enumerate(kept, 1):
        assert assert_as_alone(spoken, trusted[offset], reference[offset])
    for engine in (thinker, engines.talker):
        assert engine.scheduler.runner.rows.requests == []  # nothing left anywhere
    engines.rows.clear()
