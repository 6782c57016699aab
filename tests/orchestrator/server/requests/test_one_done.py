"""Every request the orchestrator takes ends exactly once, with one Done per
request id sent on a stream (issue 35), through real stage processes: an id
reused on one GenerateStream (its input still open, or after its last window),
an id in flight on another stream, Cancels racing their requests' ends, and the
orchestrator stopping under requests in flight (each gets its UNAVAILABLE Done
before the server goes; none is left waiting)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator

import grpc

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from tests.helpers.polling import eventually
from tests.orchestrator.conftest import orchestrator, pipeline


def submit(
    rid: str, prompt: str, max_tokens: int, last: bool = True
) -> orchestrator_pb2.StreamInput:
    message = stage_pb2.Submit(
        request_id=rid,
        inputs=stage_pb2.StageInputs(messages=[stage_pb2.ChatMessage(role="user", content=prompt)]),
        params=stage_pb2.GenerationParams(max_tokens=max_tokens),
        is_last=last,
    )
    return orchestrator_pb2.StreamInput(submit=message)


def cancel(rid: str) -> orchestrator_pb2.StreamInput:
    return orchestrator_pb2.StreamInput(cancel=stage_pb2.Cancel(request_id=rid))


class Stream:
    """One GenerateStream, its events read as they come, writes one at a time."""

    def __init__(self, client) -> None:
        self.call = client.stub.GenerateStream()
        self.events: list[orchestrator_pb2.GenerateEvent] = []
        self._reader = asyncio.create_task(self._read())
        self._writing = asyncio.Lock()

    async def _read(self) -> None:
        while (event := await self.call.read()) is not grpc.aio.EOF:
            self.events.append(event)

    async def send(self, *messages: orchestrator_pb2.StreamInput) -> None:
        async with self._writing:
            for message in messages:
                await self.call.write(message)

    def dones(self, rid: str | None = None) -> list[orchestrator_pb2.Done]:
        return [
            e.done
            for e in self.events
            if e.WhichOneof("kind") == "done" and rid in (None, e.done.request_id)
        ]

    def started(self, rid: str) -> bool:
        return any(
            e.WhichOneof("kind") == "segment" and e.segment.request_id == rid for e in self.events
        )

    async def end(self) -> Counter[str]:
        await self.call.done_writing()
        await asyncio.wait_for(self._reader, 60)
        return Counter(d.request_id for d in self.dones())


async def test_ids_reused_on_a_stream_or_across_streams_end_once(stages) -> None:
    async with orchestrator(pipeline(stages, ["thinker"], [])) as (_server, client):
        first, second = Stream(client), Stream(client)
        # Its input still open, then a second first Submit of the id.
        await first.send(submit("open", "Hello", 4, last=False), submit("open", "Again", 4))
        # After its last window: a Submit of the id again.
        await first.send(submit("whole", "Write at length.", 300))
        await eventually(lambda: first.started("whole"), 60)
        await first.send(submit("whole", "Again", 4))
        # In flight on the first stream, sent on the second: refused there alone.
        await first.send(submit("both", "Write at length.", 300))
        await eventually(lambda: first.started("both"), 60)
        await second.send(submit("both", "Hi", 2))
        await eventually(lambda: second.dones("both"), 60)
        await first.send(cancel("both"))
        assert await second.end() == {"both": 1}
        assert await first.end() == {"open": 1, "whole": 1, "both": 1}
    for rid in ("open", "whole"):
        (done,) = first.dones(rid)
        assert done.code_name == "INVALID_ARGUMENT" and done.field == "submit.request_id", done
    # In the client's words: its own id, not the one the stage knew it by.
    assert "request 'open' ends here" in first.dones("open")[0].message
    assert second.dones("both")[0].code_name == "INVALID_ARGUMENT"
    assert first.dones("both")[0].code_name == "CANCELLED"


async def test_cancels_racing_their_requests_end_end_each_once(stages) -> None:
    async with orchestrator(pipeline(stages, ["thinker"], [])) as (_server, client):
        stream = Stream(client)
        rng = random.Random(35)
        rids = [f"race-{n}" for n in range(16)]

        async def race(rid: str) -> None:
            await stream.send(submit(rid, "Hi", rng.randint(1, 4)))
            await asyncio.sleep(rng.uniform(0, 0.4))
            await stream.send(cancel(rid))

        await stream.send(submit("at-once", "Hi", 50), cancel("at-once"))
        await asyncio.gather(*(race(rid) for rid in rids))
        await stream.send(submit("late", "Hi", 1))
        await eventually(lambda: stream.dones("late"), 60)
        await stream.send(cancel("late"), cancel("late"), cancel("nobody"))
        finals = await stream.end()
    assert finals == dict.fromkeys(["at-once", *rids, "late", "nobody"], 1)
    assert stream.dones("nobody")[0].code_name == "NOT_FOUND"
    assert stream.dones("late")[0].code_name == "OK"


async def test_the_orchestrator_stopping_ends_each_request_once(stages) -> None:
    async with orchestrator(pipeline(stages, ["thinker"], [])) as (server, client):
        # Under way (its first event out): a request that had sent nothing would end
        # UNAVAILABLE alone, the server going away, for its client to try elsewhere
        # (tests/orchestrator/server/test_two_orchestrators.py).
        events = aiter(
            client.generate("Write at length.", request_id="unary", params={"max_tokens": 3000})
        )
        first = await asyncio.wait_for(anext(events), 60)
        assert first.WhichOneof("kind") == "segment"
        unary = asyncio.create_task(_last(events))
        stream = Stream(client)
        await stream.send(
            submit("s1", "Write at length.", 3000), submit("s2", "Write at length.", 3000)
        )
        # All three in flight (the thinker runs one at a time: the others queue there).
        await eventually(lambda: server.router.in_flight == 3, 60)
        await server.stop(5.0)
        result = await asyncio.wait_for(unary, 30)
        # The stream ends with the server (its status is not a request's).
        await asyncio.wait_for(asyncio.gather(stream._reader, return_exceptions=True), 30)
    assert result.code_name == "UNAVAILABLE" and "stopping" in result.message
    assert Counter(d.request_id for d in stream.dones()) == {"s1": 1, "s2": 1}
    assert all(d.code_name == "UNAVAILABLE" and "stopping" in d.message for d in stream.dones())


async def _last(
    events: AsyncIterator[orchestrator_pb2.GenerateEvent],
) -> orchestrator_pb2.Done:
    """The Done that ends ``events``."""
    async for event in events:
        if event.WhichOneof("kind") == "done":
            return event.done
    raise AssertionError("the request ended without a Done")
