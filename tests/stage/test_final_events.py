"""Every request a stage takes ends exactly once (issue 35): one final event,
Completed or Error, per request id sent on a stream, on every path, against a
stage process: an id reused while in flight on one stream (running, waiting for
its windows, or written right behind its first Submit), an id in flight on
another stream, and Cancels that race the request's own end. After each, the
stream ends once its client half-closes: nothing is left waiting."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrator.cli.processes import StageProcess
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import StageClient
from services.testing.configs import tiny_config, write_config
from tests.helpers.polling import eventually
from tests.helpers.stage import cancel, chat


@pytest.fixture(scope="module")
async def stage(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path, smollm2_gguf: Path
) -> AsyncIterator[StageClient]:
    folder = tmp_path_factory.mktemp("final-events")
    runtime = {"torch_threads": 1, "max_batch_size": 4, "max_queue_size": 64}
    config = tiny_config("thinker", omni_cache_dir, runtime=runtime)
    process = StageProcess(write_config(folder / "thinker.yaml", config))
    address = await process.start()
    try:
        async with StageClient(address) as client:
            await client.wait_ready(timeout_s=180)
            yield client
    finally:
        await process.stop(5)


class Stream:
    """One Generate stream, its outputs read as they come."""

    def __init__(self, client: StageClient) -> None:
        self.call = client.open_stream()
        self.outputs: list[stage_pb2.StageOutput] = []
        self._reader = asyncio.create_task(self._read())
        self._writing = asyncio.Lock()  # one write at a time on a call

    async def _read(self) -> None:
        while (output := await self.call.read()) is not grpc.aio.EOF:
            self.outputs.append(output)

    async def send(self, *messages: stage_pb2.StageInput) -> None:
        async with self._writing:
            for message in messages:
                await self.call.write(message)

    def finals(self) -> Counter[str]:
        kinds = [(o.WhichOneof("kind"), o) for o in self.outputs]
        return Counter(getattr(o, k).request_id for k, o in kinds if k in ("completed", "error"))

    def of(self, rid: str, kind: str) -> list:
        return [
            getattr(o, kind)
            for o in self.outputs
            if o.WhichOneof("kind") == kind and getattr(o, kind).request_id == rid
        ]

    async def until(self, rid: str, kind: str) -> None:
        await eventually(lambda: self.of(rid, kind), 60, interval=0.01)

    async def end(self) -> Counter[str]:
        """Half-close and read to the end (which must come); the finals by id."""
        await self.call.done_writing()
        await asyncio.wait_for(self._reader, 60)
        return self.finals()


def long(rid: str) -> stage_pb2.StageInput:
    return chat(rid, "Write at length.", max_tokens=400)


def opening(rid: str) -> stage_pb2.StageInput:
    """A first window: its request waits for more."""
    message = chat(rid, "Hello")
    message.submit.is_last = False
    return message


async def test_an_id_reused_while_in_flight_ends_that_request_once(stage) -> None:
    stream = Stream(stage)
    # Running: its first segment has come.
    await stream.send(long("running"))
    await stream.until("running", "segment")
    await stream.send(chat("running", "Again", max_tokens=2))
    # Waiting for its next window; and written right behind its first Submit.
    await stream.send(opening("waiting"), chat("waiting", "Again", max_tokens=2))
    await stream.send(long("behind"), long("behind"))
    await stream.until("behind", "error")
    # Once ended, the id is free: a new request of it runs to its end.
    await stream.send(chat("running", "Hi", max_tokens=3))
    await stream.until("running", "completed")
    finals = await stream.end()
    assert finals == {"running": 2, "waiting": 1, "behind": 1}  # "running" twice: two requests
    for rid in ("running", "waiting", "behind"):
        (error,) = stream.of(rid, "error")
        assert (error.code_name, error.field) == ("INVALID_ARGUMENT", "submit.request_id")
        assert f"request {rid!r} ends here" in error.message
    # Nothing of the ended request comes after its end: what follows of the id is
    # the new request's three tokens.
    ended = next(i for i, o in enumerate(stream.outputs) if o.error.request_id == "running")
    later = [
        o.segment
        for o in stream.outputs[ended + 1 :]
        if o.WhichOneof("kind") == "segment" and o.segment.request_id == "running"
    ]
    assert sum(len(s.token_ids) for s in later) == 3 and later[0].sequence == 0


async def test_an_id_in_flight_on_another_stream_is_refused_there_alone(stage) -> None:
    first, second = Stream(stage), Stream(stage)
    await first.send(long("shared"))
    await first.until("shared", "segment")
    await second.send(chat("shared", "Hi", max_tokens=2))
    await second.until("shared", "error")
    await first.send(cancel("shared"))
    assert await second.end() == {"shared": 1}
    assert await first.end() == {"shared": 1}
    (refused,) = second.of("shared", "error")
    assert "on another stream" in refused.message
    (cancelled,) = first.of("shared", "error")
    assert cancelled.code_name == "CANCELLED"


async def test_cancels_racing_their_requests_end_end_each_once(stage) -> None:
    stream = Stream(stage)
    # A Cancel right behind its Submit, and one long after its end: one final each.
    await stream.send(long("at-once"), cancel("at-once"))
    await stream.send(chat("done", "Hi", max_tokens=2))
    await stream.until("done", "completed")
    await stream.send(cancel("done"), cancel("done"))
    # Cancels sent at every moment of short requests' lives, many at once.
    rng = random.Random(35)
    rids = [f"race-{n}" for n in range(24)]

    async def race(rid: str) -> None:
        await stream.send(chat(rid, "Hi", max_tokens=rng.randint(1, 6)))
        await asyncio.sleep(rng.uniform(0, 0.3))
        await stream.send(cancel(rid))

    await asyncio.gather(*(race(rid) for rid in rids))
    # An id this stream never saw: its Cancel is answered, once.
    await stream.send(cancel("nobody"))
    finals = await stream.end()
    assert finals == dict.fromkeys(["at-once", "done", *rids, "nobody"], 1)
    assert stream.of("nobody", "error")[0].code_name == "NOT_FOUND"
    assert stream.of("at-once", "error")[0].code_name == "CANCELLED"
