"""Helpers for talking to a real Stage service in tests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.mesh.pb.omni.v1 import stage_pb2


def chat(request_id: str, prompt: str, **params: Any) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(
        submit=stage_pb2.Submit(
            request_id=request_id,
            inputs=stage_pb2.StageInputs(
                messages=[stage_pb2.ChatMessage(role="user", content=prompt)]
            ),
            params=stage_pb2.GenerationParams(**params),
            is_last=True,
        )
    )


def cancel(request_id: str) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(cancel=stage_pb2.Cancel(request_id=request_id))


@dataclass
class Result:
    segments: list[stage_pb2.Segment] = field(default_factory=list)
    progress: list[stage_pb2.Progress] = field(default_factory=list)
    completed: stage_pb2.Completed | None = None
    error: stage_pb2.Error | None = None

    @property
    def text(self) -> str:
        return "".join(s.text_delta for s in self.segments)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]


def record(results: dict[str, Result], output: stage_pb2.StageOutput) -> str:
    """Add one output to ``results``; returns its request id ("" for a chunk,
    which is left out: tests of chunks read the stream themselves)."""
    kind = output.WhichOneof("kind")
    if kind == "chunk":
        return ""
    event = getattr(output, kind)
    result = results[event.request_id]
    if kind == "segment":
        result.segments.append(event)
    elif kind == "progress":
        result.progress.append(event)
    elif kind == "completed":
        result.completed = event
    else:
        result.error = event
    return event.request_id


async def collect(
    outputs: AsyncIterator[stage_pb2.StageOutput] | grpc.aio.StreamStreamCall,
    results: dict[str, Result] | None = None,
) -> dict[str, Result]:
    """Every output until the stream ends, by request id. A raw call is read with
    ``read()`` (grpc.aio does not allow mixing ``read()`` and iteration)."""
    results = defaultdict(Result) if results is None else results
    if isinstance(outputs, grpc.aio.StreamStreamCall):
        while (output := await outputs.read()) is not grpc.aio.EOF:
            record(results, output)
        return results
    async for output in outputs:
        record(results, output)
    return results
