"""One request's share of a replica's shared Generate stream (``replica_stream``).

What a request writes goes on the shared stream; what the replica sends for it
waits here, in its own queue, until its flow reads it. Flow control is per
request (``Submit.credit``): a request starts with ``CREDIT`` outputs and its
flow grants them back as it takes what came, so a request whose consumer is
slow pauses on the stage alone while the others on the stream go on, and what
waits here for it stays bounded. Until the replica has said something of a
request whose only Submit is still in hand (``replay``), the request may move
to another replica if the stream breaks (``stage_mux``). What it has sent so far
weighs on its replica's load (``Replica.beyond``) while it runs.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from orchestrator.server.stages.replica import beyond
from services.mesh.data.chunk_wire import EncodedChunk
from services.mesh.errors import OmniError
from services.mesh.pb.omni.v1 import stage_pb2

if TYPE_CHECKING:  # the stream holds its requests' shares: a cycle at run time
    from orchestrator.server.requests.replica_stream import ReplicaStream
    from orchestrator.server.stages.replica import Replica

CREDIT = 16  # outputs a request may have on their way before its flow takes them
GRANT_EVERY = 8  # outputs taken before they are granted back, in one Credit
_CREDITED = ("segment", "progress")


class RequestStream:
    """One request's share of a replica's stream: its writes, its outputs, its credit."""

    def __init__(self, stream: ReplicaStream, request_id: str) -> None:
        self.request_id = request_id
        self._stream = stream
        self._queue: asyncio.Queue[stage_pb2.StageOutput | OmniError] = asyncio.Queue()
        self._owed = 0  # taken outputs not yet granted back
        self._sent = False
        self._closed = False
        self._heard = False  # the replica has sent something for it
        self._outputs = 0  # tokens, windows and steps it has sent (its weight: beyond)
        # Its one whole Submit, posted before anything else was sent: until the
        # replica says something of it, the request may move to another replica.
        self.replay: stage_pb2.StageInput | None = None
        self.final = False
        stream.replica.took()

    @property
    def replica(self) -> Replica:
        return self._stream.replica

    @property
    def address(self) -> str:
        """The replica's, as its errors name it."""
        return self._stream.replica.address

    @property
    def movable(self) -> bool:
        return self.replay is not None and not self._heard and not self._closed

    def moved(self, stream: ReplicaStream) -> None:
        """Now on ``stream`` (another replica's): its Submit is posted there again."""
        assert self.replay is not None
        self._stream.replica.gave_back(heard=False)
        self._stream = stream
        stream.adopt(self)
        stream.replica.took()
        self._stream.post(self.replay)

    @property
    def buffered(self) -> int:
        """Outputs that came for this request and its flow has not read yet."""
        return self._queue.qsize()

    async def write(self, message: stage_pb2.StageInput | EncodedChunk) -> None:
        """Send on the shared stream (the first Submit carries the request's credit:
        ``submits``)."""
        self._sent = True
        await self._stream.write(message)

    def post(self, message: stage_pb2.StageInput) -> None:
        """Send without waiting for the write (a request's last Submit, whole): in
        order after what came before; if the stream breaks, ``read`` says so."""
        if not self._sent:
            self.replay = message
        self._sent = True
        self._stream.post(message)

    async def read(self) -> stage_pb2.StageOutput:
        """The request's next output; raises StreamBroken (or an OmniError from
        assembling its chunks) when there will be no more."""
        item = await self._queue.get()
        if isinstance(item, OmniError):
            raise item
        return item

    def taken(self, output: stage_pb2.StageOutput) -> None:
        """The flow has handed ``output`` on: its credit goes back to the stage."""
        if output.WhichOneof("kind") not in _CREDITED or self.final:
            return
        self._owed += 1
        if self._owed >= GRANT_EVERY:
            credit = stage_pb2.Credit(request_id=self.request_id, outputs=self._owed)
            self._owed = 0
            self._stream.post(stage_pb2.StageInput(credit=credit))

    def deliver(self, item: stage_pb2.StageOutput | OmniError) -> None:
        if not self._heard:
            self._heard = True
            self.replay = None
            self._stream.replica.queued -= 1
        if isinstance(item, stage_pb2.StageOutput):
            self._count(item)
        self._queue.put_nowait(item)

    def _count(self, output: stage_pb2.StageOutput) -> None:
        kind = output.WhichOneof("kind")
        if kind == "segment":
            outputs = len(output.segment.token_ids) or 1
        elif kind == "progress":
            outputs = 1
        else:
            return
        before = beyond(self._outputs)
        self._outputs += outputs
        self._stream.replica.beyond += beyond(self._outputs) - before

    def close(self) -> None:
        """The request is done with this stage: if the stage has not ended it,
        it is cancelled on the shared stream (the stream goes on)."""
        if self._closed:
            return
        self._closed = True
        self.replay = None
        self._stream.replica.beyond -= beyond(self._outputs)
        self._stream.replica.gave_back(self._heard)
        self._stream.leave(self, cancel=self._sent and not self.final)
