"""Property-based fuzz of Stage.Generate (StageInput) and Orchestrator.GenerateStream
(StreamInput) with arbitrary messages (built from the contract's descriptors, see
strategies.py) and raw byte frames, on one real stage and orchestrator for the
whole module.

Invariants, whatever arrives: each request id gets exactly one final event
(Completed/Error, or Done) when no other message shares it, and at most one per
Submit when they do (windows of one id); no final event is UNKNOWN or INTERNAL,
or shows a Python class or traceback; the stream ends OK, or INVALID_ARGUMENT
exactly when a frame was no message of the method (never hangs); the stream's
ordinary request completes in full; and a control request on a fresh stream
completes afterwards.

Bounded for CI: a fixed number of examples, each with a timeout, and a
wall-clock budget after which the remaining examples are skipped. Examples are
derandomized (the same on every run; no example database), and a failure
prints the blob that reproduces it (@reproduce_failure)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from tests.hostile.conftest import Mesh
from tests.hostile.fuzz_harness import (
    BAD_CODES,
    BUDGET_S,
    FUZZ,
    Runner,
    control,
    fuzz,
    generate_once,
)
from tests.hostile.strategies import WORDS, messages

logger = logging.getLogger(__name__)

GENERATION_PARAMS = messages(stage_pb2.GenerationParams.DESCRIPTOR)
# A chat that a model can take, with arbitrary parameters: reaches the engine.
PLAUSIBLE = st.builds(
    lambda rid, content, params, last: stage_pb2.StageInput(
        submit=stage_pb2.Submit(
            request_id=rid,
            inputs=stage_pb2.StageInputs(
                messages=[stage_pb2.ChatMessage(role="user", content=content)]
            ),
            params=params,
            is_last=last,
        )
    ),
    st.sampled_from(["p", "q", ""]),
    st.sampled_from(WORDS[1:]),
    GENERATION_PARAMS,
    st.booleans(),
)
FRAME = st.one_of(
    messages(stage_pb2.StageInput.DESCRIPTOR),
    PLAUSIBLE,
    st.binary(max_size=40),  # raw frames: most are no StageInput
)


async def test_fuzz_stage_inputs_with_their_own_ids(mesh: Mesh) -> None:
    ran = await fuzz(mesh, st.lists(FRAME, min_size=1, max_size=4), unique_ids=True)
    assert ran >= 10  # the budget let the fuzz do something


async def test_fuzz_windows_of_one_request(mesh: Mesh) -> None:
    window = st.builds(
        _windowed,
        st.one_of(messages(stage_pb2.StageInput.DESCRIPTOR), PLAUSIBLE),
        st.integers(0, 3),
        st.booleans(),
    )
    ran = await fuzz(mesh, st.lists(window, min_size=1, max_size=5), unique_ids=False)
    assert ran >= 10


async def test_fuzz_orchestrator_stream_inputs(mesh: Mesh) -> None:
    frame = st.one_of(
        messages(orchestrator_pb2.StreamInput.DESCRIPTOR), PLAUSIBLE, st.binary(max_size=40)
    )
    ran = await fuzz(mesh, st.lists(frame, min_size=1, max_size=4), unique_ids=True, at_stage=False)
    assert ran >= 10


def _request(item: Any) -> bytes:
    """A GenerateRequest's frame: bytes as they are, long generations cut short."""
    if isinstance(item, bytes):
        return item
    for params in [item.params, *item.stage_params.values()]:
        if 32 < params.max_tokens <= 100_000:
            params.max_tokens = 32
    return item.SerializeToString()


async def test_fuzz_orchestrator_generate_requests(mesh: Mesh) -> None:
    runner = Runner(asyncio.get_running_loop())
    plausible = PLAUSIBLE.map(
        lambda m: orchestrator_pb2.GenerateRequest(
            request_id=m.submit.request_id, inputs=m.submit.inputs, params=m.submit.params
        )
    )
    requests = st.one_of(
        messages(orchestrator_pb2.GenerateRequest.DESCRIPTOR), plausible, st.binary(max_size=40)
    )

    @FUZZ
    @given(item=requests)
    def one(item: Any) -> None:
        if runner.over_budget() and not runner.failing:
            return
        runner.examples += 1
        frame = _request(item)
        try:
            decodable = True
            try:
                orchestrator_pb2.GenerateRequest.FromString(frame)
            except (DecodeError, UnicodeDecodeError, ValueError):
                decodable = False
            status, finals = runner.run(generate_once(mesh, frame))
            assert len(finals) == (1 if decodable else 0), finals
            # The RPC ends with its request's status: the Done's, else undecodable.
            assert status == (finals[0].code if decodable else "INVALID_ARGUMENT"), status
            for final in finals:
                assert final.code not in BAD_CODES, final
                assert "<class" not in final.message and "Traceback" not in final.message
            runner.run(control(mesh, f"control-generate-{runner.examples}"))
        except BaseException:
            runner.failing = True
            raise

    await asyncio.to_thread(one)
    logger.info("fuzz: %d requests in the budget of %ss", runner.examples, BUDGET_S)
    await mesh.serving()
    assert runner.examples >= 10


def _windowed(message: stage_pb2.StageInput, seq: int, last: bool) -> stage_pb2.StageInput:
    if message.WhichOneof("kind") == "submit":
        message.submit.sequence, message.submit.is_last = seq, last
    return message
