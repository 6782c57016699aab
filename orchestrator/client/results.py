"""What a request returned: every event of it by output stage, its audio written
as it arrives, and its final status (``Result``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.client.audio import AudioFiles
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2, tensor_pb2

MAX_CHUNKED_BYTES = 16 << 30


@dataclass
class StageResult:
    """What one output stage produced for a request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tensors: dict[str, list[tensor_pb2.Tensor]] = field(default_factory=dict)
    blobs: list[tensor_pb2.Blob] = field(default_factory=list)
    progress: int = 0
    completed: stage_pb2.Completed | None = None


@dataclass
class Result:
    """Every event of one request, by stage, and its final status."""

    stages: dict[str, StageResult] = field(default_factory=dict)
    done: orchestrator_pb2.Done | None = None
    # Where each output stage's audio is written as it arrives (orchestrator/client/audio.py,
    # <audio_dir>/<request id>-<stage>.wav); None: kept in ``stages`` only.
    audio_dir: Path | None = None
    audio: AudioFiles | None = None
    # Tensors and blobs too large for one message arrive as chunks before their segment.
    _chunks: ChunkAssembler = field(default_factory=lambda: ChunkAssembler(MAX_CHUNKED_BYTES))

    @property
    def ok(self) -> bool:
        return self.done is not None and self.done.code == 0

    def add(self, event: orchestrator_pb2.GenerateEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "done":
            self.done = event.done
            if self.audio is not None:
                self.audio.close()
            return
        if kind == "chunk":
            self._chunks.add(event.chunk)
            return
        stage = self.stages.setdefault(event.stage, StageResult())
        if kind == "segment":
            seg = event.segment
            self._chunks.resolve(seg.tensors, "segment.tensors")
            self._chunks.resolve_blobs(seg.blobs, "segment.blobs")
            stage.text += seg.text_delta
            stage.token_ids.extend(seg.token_ids)
            for tensor in seg.tensors:
                stage.tensors.setdefault(tensor.name, []).append(tensor)
            stage.blobs.extend(seg.blobs)
            if self.audio_dir is not None:
                self.audio = self.audio or AudioFiles(self.audio_dir)
                self.audio.add(event.stage, seg)
        elif kind == "progress":
            stage.progress += 1
        elif kind == "completed":
            stage.completed = event.completed
