"""The harness of the hostile fuzz (test_fuzz.py): frames prepared from what
hypothesis draws, sent on one stream after an ordinary request, every final event
read back and checked against the invariants, under an examples count and a
wall-clock budget."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.rpc.stage_client import chat_submit
from tests.hostile.conftest import Mesh

BUDGET_S = float(os.environ.get("OMNI_FUZZ_BUDGET_S", "15"))  # per test (four)
EXAMPLES = int(os.environ.get("OMNI_FUZZ_EXAMPLES", "120"))
ORDINARY_TOKENS = 3
BAD_CODES = {"UNKNOWN", "INTERNAL", "DATA_LOSS"}
# A Cancel or end of input for an id not in flight is answered NOT_FOUND naming these.
CROSSING_FIELDS = {"cancel.request_id", "submit.input_ended"}
T = TypeVar("T")
logger = logging.getLogger(__name__)

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # each example has its own timeout (the stream's)
    # The same examples on every run unless OMNI_FUZZ_RANDOM=1 (a longer hunt by hand).
    derandomize=os.environ.get("OMNI_FUZZ_RANDOM") != "1",
    database=None,
    print_blob=True,
    # No shrinking: on real servers it runs for many minutes; the failing example is
    # printed as found.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Sent:
    frames: list[bytes]
    decoded: list[Message]  # the frames up to the first that is no message of the method
    undecodable: bool

    def named(self) -> tuple[set[str], Counter[str]]:
        """Request ids the messages name (Submits and Cancels), and Submits per id."""
        ids: set[str] = set()
        submits: Counter[str] = Counter()
        for message in self.decoded:
            kind = message.WhichOneof("kind")
            if kind in ("submit", "cancel"):
                ids.add(getattr(message, kind).request_id)
            if kind == "submit":
                submits[message.submit.request_id] += 1
        return ids - {""}, submits


def prepare(
    items: list[Any], cls: type[Message], *, unique_ids: bool, window_id: str = "w"
) -> Sent:
    """Frames to send: messages serialised, bytes as they are. With ``unique_ids``
    no two messages share a request id; otherwise every Submit and Cancel is for
    ``window_id``. Long generations are cut short (the fuzz is about input)."""
    frames: list[bytes] = []
    decoded: list[Message] = []
    seen: set[str] = set()
    for n, item in enumerate(items):
        try:
            # Field numbers 1-3 of StreamInput are StageInput's: either reads the other.
            raw = item if isinstance(item, bytes) else item.SerializeToString()
            message = cls.FromString(raw)
        except (DecodeError, UnicodeDecodeError, ValueError):
            frames.append(raw)
            return Sent(frames, decoded, undecodable=True)
        kind = message.WhichOneof("kind")
        if kind in ("submit", "cancel"):
            holder = getattr(message, kind)
            if not unique_ids:
                holder.request_id = window_id
            elif holder.request_id:
                while holder.request_id in seen:
                    holder.request_id = f"{holder.request_id}~{n}"
                seen.add(holder.request_id)
        if kind == "submit" and 32 < message.submit.params.max_tokens <= 100_000:
            message.submit.params.max_tokens = 32
        decoded.append(message)
        frames.append(message.SerializeToString())
    return Sent(frames, decoded, undecodable=False)


@dataclass(frozen=True)
class Final:
    request_id: str
    code: str
    field: str
    message: str


async def exchange(
    mesh: Mesh, sent: Sent, ordinary: str, *, at_stage: bool
) -> tuple[str, list[Final], int]:
    """The frames on one stream (the stage's Generate or the orchestrator's
    GenerateStream) after an ordinary request: the stream's status, every final
    event, and the ordinary request's tokens."""
    submit = chat_submit(ordinary, "Hi", max_tokens=ORDINARY_TOKENS, temperature=0.0)
    if at_stage:
        first = stage_pb2.StageInput(submit=submit)
        method, reply = "/omni.v1.Stage/Generate", stage_pb2.StageOutput
        address, token = mesh.stage_address, mesh.mesh_token
    else:
        first = orchestrator_pb2.StreamInput(submit=submit)
        method, reply = "/omni.v1.Orchestrator/GenerateStream", orchestrator_pb2.GenerateEvent
        address, token = mesh.address, mesh.tokens["alice"]
    finals: list[Final] = []
    tokens = 0
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(method, response_deserializer=reply.FromString)(
            metadata=(("authorization", f"Bearer {token}"),), timeout=30
        )
        try:
            await call.write(first.SerializeToString())
            for frame in sent.frames:
                await call.write(frame)
            await call.done_writing()
            while (output := await call.read()) is not grpc.aio.EOF:
                kind = output.WhichOneof("kind")
                if kind == "segment" and output.segment.request_id == ordinary:
                    tokens += len(output.segment.token_ids)
                if kind in ("error", "done"):
                    event = getattr(output, kind)
                    finals.append(
                        Final(event.request_id, event.code_name, event.field, event.message)
                    )
                elif kind == "completed" and at_stage:
                    finals.append(Final(output.completed.request_id, "OK", "", ""))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the stream hung"
            return exc.code().name, finals, tokens
    return (await call.code()).name, finals, tokens


async def control(mesh: Mesh, request_id: str) -> None:
    async with mesh.stage() as stage:
        submit = chat_submit(request_id, "Hi", max_tokens=ORDINARY_TOKENS, temperature=0.0)
        outputs = [o async for o in stage.generate(submit)]
    assert outputs[-1].WhichOneof("kind") == "completed", outputs[-1]
    assert sum(len(o.segment.token_ids) for o in outputs) == ORDINARY_TOKENS


def check(
    sent: Sent, status: str, finals: list[Final], tokens: int, ordinary: str, *, unique_ids: bool
) -> None:
    assert status == ("INVALID_ARGUMENT" if sent.undecodable else "OK"), status
    counts: Counter[str] = Counter()
    for final in finals:
        assert final.code not in BAD_CODES, final
        assert "<class" not in final.message and "Traceback" not in final.message, final
        # A Cancel (or end of input) that crossed its request's end is answered NOT_FOUND.
        crossed = final.code == "NOT_FOUND" and final.field in CROSSING_FIELDS
        if unique_ids or not crossed:
            counts[final.request_id] += 1
    if sent.undecodable:
        return  # the RPC ended: requests in flight on it ended with it
    assert counts[ordinary] == 1 and tokens == ORDINARY_TOKENS, "the ordinary request was hurt"
    named, submits = sent.named()
    for rid in named:
        if unique_ids:
            assert counts[rid] == 1, (rid, counts)
        else:
            assert min(submits[rid], 1) <= counts[rid] <= submits[rid], (rid, counts, submits)


class Runner:
    """Runs coroutines on the servers' event loop from hypothesis's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ends = time.monotonic() + BUDGET_S
        self.examples = 0
        self.failing = False

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=60)

    def over_budget(self) -> bool:
        return time.monotonic() > self.ends


async def fuzz(
    mesh: Mesh, strategy: st.SearchStrategy[list[Any]], *, unique_ids: bool, at_stage: bool = True
) -> int:
    runner = Runner(asyncio.get_running_loop())
    cls = stage_pb2.StageInput if at_stage else orchestrator_pb2.StreamInput

    @FUZZ
    @given(items=strategy)
    def one(items: list[Any]) -> None:
        if runner.over_budget() and not runner.failing:
            return  # past the budget the rest pass untried (a failure still shrinks)
        runner.examples += 1
        n = runner.examples
        sent = prepare(items, cls, unique_ids=unique_ids)
        ordinary = f"ordinary-{n}"
        try:
            status, finals, tokens = runner.run(exchange(mesh, sent, ordinary, at_stage=at_stage))
            check(sent, status, finals, tokens, ordinary, unique_ids=unique_ids)
            runner.run(control(mesh, f"control-{n}"))
        except BaseException:
            runner.failing = True
            raise

    await asyncio.to_thread(one)
    logger.info("fuzz: %d examples in the budget of %ss", runner.examples, BUDGET_S)
    await mesh.serving()
    assert mesh.stage_server.runtime.in_flight == 0
    return runner.examples


async def generate_once(mesh: Mesh, frame: bytes) -> tuple[str, list[Final]]:
    """One Orchestrator.Generate with ``frame`` as its request: status and Dones."""
    finals: list[Final] = []
    metadata = (("authorization", f"Bearer {mesh.tokens['alice']}"),)
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        call = channel.unary_stream(
            "/omni.v1.Orchestrator/Generate",
            response_deserializer=orchestrator_pb2.GenerateEvent.FromString,
        )(frame, metadata=metadata, timeout=30)
        try:
            async for event in call:
                if event.WhichOneof("kind") == "done":
                    done = event.done
                    finals.append(Final(done.request_id, done.code_name, done.field, done.message))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the call hung"
            return exc.code().name, finals
    return "OK", finals
