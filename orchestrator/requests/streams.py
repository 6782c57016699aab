"""Adapters from client input streams to the router's per-request inputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from orchestrator.requests.router import Router
from orchestrator.requests.sink import EventSink
from services.mesh.errors import InvalidArgument, OmniError
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2


def refuse_refs(inputs: stage_pb2.StageInputs, field: str = "inputs") -> None:
    """Clients send bytes: a shared-memory or CUDA IPC ref names memory of a mesh
    process, and only the mesh's own stages may hand those to each other."""
    for index, tensor in enumerate(inputs.tensors):
        if tensor.WhichOneof("data") in ("shm", "cuda_ipc"):
            name = f"{field}.tensors[{index}]"
            raise InvalidArgument(
                f"{name}: tensor refs are only accepted from inside the mesh; send bytes",
                field=name,
            )


async def single(submit: stage_pb2.Submit) -> AsyncIterator[stage_pb2.Submit]:
    yield submit


async def _drain(queue: asyncio.Queue[stage_pb2.Submit | None]) -> AsyncIterator[stage_pb2.Submit]:
    while (submit := await queue.get()) is not None:
        yield submit


def _refusal(request_id: str, error: OmniError) -> orchestrator_pb2.GenerateEvent:
    return orchestrator_pb2.GenerateEvent(
        done=orchestrator_pb2.Done(
            request_id=request_id,
            code=error.code.value[0],
            code_name=error.code.name,
            message=error.message,
        )
    )


async def stream_requests(
    router: Router,
    inputs: AsyncIterator[stage_pb2.StageInput],
    watermarks: tuple[int, int] = (256, 64),
) -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
    """GenerateStream: windows of several requests in, every request's events out.

    A request starts at its first Submit; its later Submits (windows) are fed to
    the entry stage as they arrive. The stream ends when the client has
    half-closed and every request it started has had its Done.
    """
    sink = EventSink(*watermarks)
    feeds: dict[str, asyncio.Queue[stage_pb2.Submit | None]] = {}
    open_requests: set[str] = set()
    reading = True

    async def read() -> None:
        nonlocal reading
        try:
            async for message in inputs:
                if message.WhichOneof("kind") == "cancel":
                    router.abort([message.cancel.request_id])
                    continue
                submit = message.submit
                rid = submit.request_id
                try:
                    if not rid:
                        raise InvalidArgument(
                            "submit.request_id: must not be empty", field="submit.request_id"
                        )
                    refuse_refs(submit.inputs, "submit.inputs")
                    feed = feeds.get(rid)
                    if feed is None:
                        feed = feeds[rid] = asyncio.Queue()
                        router.start(rid, _drain(feed), {}, sink)
                        open_requests.add(rid)
                    feed.put_nowait(submit)
                    if submit.is_last:
                        feed.put_nowait(None)
                        del feeds[rid]
                except OmniError as exc:
                    await sink.put(_refusal(rid, exc))
        finally:
            reading = False
            for feed in feeds.values():
                feed.put_nowait(None)  # the client stopped sending: what came is all there is
            if not open_requests:
                await sink.close()

    reader = asyncio.create_task(read())
    try:
        while (event := await sink.get()) is not None:
            yield event
            if event.WhichOneof("kind") == "done":
                open_requests.discard(event.done.request_id)
                if not reading and not open_requests:
                    break
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        for rid in list(open_requests):
            router.cancel_silently(rid)
