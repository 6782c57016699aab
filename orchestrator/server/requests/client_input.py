"""Adapters from what a client sends to the router's per-request inputs, with the
orchestrator's own request checks. A request that fails them gets its one Done
here (it never reaches the router); every other request gets it from the router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Mapping, Sequence

from orchestrator.server.requests.router import Router
from orchestrator.server.requests.sink import EventSink
from services.mesh import errors
from services.mesh.data import media_wire
from services.mesh.data.byte_budget import InputBudget, StreamAccount
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.data.ref_reader import REFS
from services.mesh.errors import InvalidArgument, NotFound, OmniError, ResourceExhausted
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.rpc.request_ids import check_request_id
from services.mesh.security import ANONYMOUS, Principal

Params = Mapping[str, stage_pb2.GenerationParams]


def refuse_refs(inputs: stage_pb2.StageInputs, field: str = "inputs") -> None:
    """Clients send bytes: a shared-memory, CUDA IPC or pull ref names memory of a
    mesh process, and only the mesh's own stages may hand those to each other (a
    pull ref from a client would also send a stage to any address it names)."""
    for index, tensor in enumerate(inputs.tensors):
        if tensor.WhichOneof("data") in REFS:
            name = f"{field}.tensors[{index}]"
            raise InvalidArgument(
                f"{name}: tensor refs are only accepted from inside the mesh; send bytes",
                field=name,
            )
    for item in media_wire.media_fields(inputs, field):
        if item.media.WhichOneof("payload") == "pcm":
            if item.media.pcm.WhichOneof("data") in REFS:
                name = f"{item.where}.pcm"
                raise InvalidArgument(
                    f"{name}: tensor refs are only accepted from inside the mesh; send bytes",
                    field=name,
                )


MAX_ABORT_IDS = 256  # ids one Abort may name (its reply names each once)


def check_abort_ids(request_ids: Sequence[str]) -> None:
    if len(request_ids) > MAX_ABORT_IDS:
        raise InvalidArgument(
            f"request_ids: expected at most {MAX_ABORT_IDS} ids, got {len(request_ids)}",
            field="request_ids",
        )
    for index, rid in enumerate(request_ids):
        check_request_id(rid, f"request_ids[{index}]")


def check_stage_params(params: Params, stages: Collection[str], field: str) -> None:
    for name in params:
        if name not in stages:
            raise InvalidArgument(
                f"{field}.{name}: unknown stage (stages: {', '.join(stages)})",
                field=f"{field}.{name}",
            )


def check_alone(
    request: orchestrator_pb2.GenerateRequest | orchestrator_pb2.StreamInput,
    stages: Collection[str],
) -> None:
    """A request for one stage alone names a known stage and gives its params in
    ``params`` (there are no other stages to give any to)."""
    if not request.stage:
        return
    if request.stage not in stages:
        raise InvalidArgument(
            f"stage: unknown stage {request.stage!r} (stages: {', '.join(stages)})", field="stage"
        )
    if request.stage_params:
        streamed = isinstance(request, orchestrator_pb2.StreamInput)
        params = "submit.params" if streamed else "params"
        raise InvalidArgument(
            f"stage_params: a request for one stage alone takes its params in {params}",
            field="stage_params",
        )


def refusal(request_id: str, error: OmniError) -> orchestrator_pb2.GenerateEvent:
    return orchestrator_pb2.GenerateEvent(done=errors.done(request_id, error))


async def single(submit: stage_pb2.Submit) -> AsyncIterator[stage_pb2.Submit]:
    yield submit


Feed = asyncio.Queue[tuple[stage_pb2.Submit, int] | None]  # (window, bytes charged)
FINISHED_KEPT = 1024  # ids whose Done a stream remembers sending


async def _drain(feed: Feed, account: StreamAccount | None) -> AsyncIterator[stage_pb2.Submit]:
    while (item := await feed.get()) is not None:
        submit, charged = item
        if account is not None:
            account.release(charged)  # it leaves this process for the entry stage's stream
        yield submit


class _StreamReader:
    """Reads one GenerateStream: chunks are assembled, a request starts at its first
    Submit, and its later Submits (windows) are fed to the entry stage as they come.

    A message that breaks a request already running (a window after its last one,
    a bad tensor in a later window) ends that request with INVALID_ARGUMENT: its
    Done is the only final event it gets, and the stream's other requests go on.
    A Cancel of an id this stream has ended (of late), or is ending, crossed its
    Done on the wire and is answered with nothing: an id gets one Done.
    """

    def __init__(
        self,
        router: Router,
        sink: EventSink,
        stages: Collection[str],
        max_bytes: int,
        owner: Principal = ANONYMOUS,
        timeout_s: float | None = None,
        budget: InputBudget | None = None,
    ):
        self._router = router
        self._owner = owner
        self._timeout_s = timeout_s
        self._sink = sink
        self._stages = stages
        # Unfinished chunks count against the stream's cap and, with every other
        # client stream's, against the server's (``budget``).
        key = "runtime.max_input_bytes"
        self._account = None if budget is None else budget.account(max_bytes, key)
        self._chunks = ChunkAssembler(max_bytes, self._account)
        self.feeds: dict[str, Feed] = {}  # input still open
        self.open: set[str] = set()  # started here, Done not yet seen
        self._finished: dict[str, None] = {}  # ids whose Done went, oldest first

    async def read(self, message: orchestrator_pb2.StreamInput) -> None:
        kind = message.WhichOneof("kind")
        if kind == "submit":
            await self._submit(message)
        elif kind == "chunk":
            try:
                self._chunks.add(message.chunk)
            except OmniError as exc:
                await self._sink.put(refusal("", exc))
        elif kind == "cancel":
            rid = message.cancel.request_id
            crossed = rid in self.open or rid in self._finished
            if not self._router.abort([rid], self._owner)[0] and not crossed:
                missing = NotFound(
                    f"cancel.request_id: no request {rid!r} in flight", field="cancel.request_id"
                )
                await self._sink.put(refusal(rid, missing))
        else:
            error = InvalidArgument("input: expected submit, chunk or cancel", field="input")
            await self._sink.put(refusal("", error))

    async def _submit(self, message: orchestrator_pb2.StreamInput) -> None:
        """A Submit: its request's first starts it (with the message's stage_params,
        affinity_key, outputs and stage); a later one is its next window."""
        submit = message.submit
        rid = submit.request_id
        started = rid in self.open
        try:
            check_request_id(rid, "submit.request_id")
            if started and rid not in self.feeds:
                raise InvalidArgument(
                    f"submit.request_id: request {rid!r} already had its last window "
                    "(is_last); it ends here",
                    field="submit.request_id",
                )
            if not started:
                check_alone(message, self._stages)
            refuse_refs(submit.inputs, "submit.inputs")
            self._router.refuse_kinds(submit.inputs, "submit.inputs", alone=message.stage)
            self._chunks.resolve(submit.inputs.tensors, "submit.inputs.tensors")
            media_wire.resolve(self._chunks, submit.inputs, "submit.inputs")
            if not started:
                check_stage_params(message.stage_params, self._stages, "stage_params")
                feed: Feed = asyncio.Queue()
                self._router.start(
                    rid,
                    _drain(feed, self._account),
                    dict(message.stage_params),
                    self._sink,
                    owner=self._owner,
                    timeout_s=self._timeout_s,
                    id_field="submit.request_id",
                    alone=message.stage,
                    affinity=message.affinity_key,
                    outputs=message.outputs,
                )
                self.feeds[rid] = feed
                self.open.add(rid)
        except OmniError as exc:
            if started:  # the request is running: it ends with this error, once
                self._close_feed(rid)
                self._router.fail(rid, exc, self._owner)
            else:
                await self._sink.put(refusal(rid, exc))
            return
        # Windows wait here until the entry stage's stream takes them (a paused mesh,
        # a slow streaming-input stage): they count against the stream's input cap.
        charged = submit.ByteSize() if self._account is not None else 0
        try:
            if self._account is not None:
                self._account.reserve(charged, "submit.inputs")
        except ResourceExhausted as exc:
            self._close_feed(rid)
            self._router.fail(rid, exc, self._owner)
            return
        self.feeds[rid].put_nowait((submit, charged))
        if submit.is_last:
            self._close_feed(rid)

    def _close_feed(self, rid: str) -> None:
        feed = self.feeds.pop(rid, None)
        if feed is not None:
            feed.put_nowait(None)

    def finished(self, request_id: str) -> None:
        """``request_id``'s Done has gone to the client."""
        self.open.discard(request_id)
        if request_id:
            self._finished.pop(request_id, None)
            self._finished[request_id] = None
            if len(self._finished) > FINISHED_KEPT:
                del self._finished[next(iter(self._finished))]

    def close(self) -> None:
        """The client stopped sending: what came is all there is."""
        for rid in list(self.feeds):
            self._close_feed(rid)

    def discard(self) -> None:
        """The stream is over: chunks nobody claimed go, and their budget with them."""
        self._chunks.discard_all()
        if self._account is not None:
            self._account.close()


async def stream_requests(
    router: Router,
    inputs: AsyncIterator[orchestrator_pb2.StreamInput],
    stages: Collection[str],
    watermarks: tuple[int, int] = (256, 64),
    max_input_bytes: int = 1 << 30,
    *,
    owner: Principal = ANONYMOUS,
    timeout_s: float | None = None,
    budget: InputBudget | None = None,
) -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
    """GenerateStream: windows of several requests in, every request's events out.

    The stream ends when the client has half-closed and every request it started
    has had its Done.
    """
    sink = EventSink(*watermarks)
    reader = _StreamReader(router, sink, stages, max_input_bytes, owner, timeout_s, budget)
    reading = True
    failed: list[Exception] = []

    async def read() -> None:
        nonlocal reading
        try:
            async for message in inputs:
                await reader.read(message)
        except Exception as exc:  # raised again by the handler, where the RPC ends
            failed.append(exc)
        finally:
            reading = False
            reader.close()
            if failed or not reader.open:
                await sink.close()

    task = asyncio.create_task(read())
    try:
        while (event := await sink.get()) is not None and not failed:
            yield event
            if event.WhichOneof("kind") == "done":
                reader.finished(event.done.request_id)
                if not reading and not reader.open:
                    break
        await task
        if failed:  # an undecodable frame: the RPC ends now, its requests with it
            raise failed[0]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        reader.discard()
        for rid in list(reader.open):
            router.cancel_silently(rid, owner)
