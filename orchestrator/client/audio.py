"""A request's audio written as it arrives: one WAV file per output stage,
``<out>/<request id>-<stage>.wav``, growing with every segment's "audio" tensor
(float32 PCM, see AudioFormat in stage.proto) and a valid WAV after each piece:
the header's sizes are rewritten each time, so a request cancelled or cut off
mid-speech leaves a playable file of what came."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from services.mesh import wav
from services.mesh.pb.omni.v1 import stage_pb2

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def file_stem(*parts: str) -> str:
    """``<request id>-<stage>`` as a file name: characters a path could misread
    (a slash, a space, ...) become "_"; dashes and dots in an id stay."""
    return "-".join(_SAFE.sub("_", p) for p in parts if p)


class GrowingWav:
    """16-bit PCM WAV at ``path``, appended to piece by piece."""

    def __init__(self, path: Path, sample_rate: int, channels: int) -> None:
        self.path, self.sample_rate, self.channels = path, sample_rate, channels
        self.data_bytes = 0
        self._file: BinaryIO = path.open("wb")
        self._file.write(wav.header(sample_rate, channels, 0))
        self._file.flush()

    def append(self, samples: np.ndarray) -> None:
        pcm = wav.pcm16(samples)
        self._file.seek(0, 2)
        self._file.write(pcm)
        self.data_bytes += len(pcm)
        self._file.seek(0)
        self._file.write(wav.header(self.sample_rate, self.channels, self.data_bytes))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class AudioFiles:
    """The growing WAV files of the requests one client reads, by (request, stage)."""

    out_dir: Path
    files: dict[tuple[str, str], GrowingWav] = field(default_factory=dict)

    def add(self, stage: str, segment: stage_pb2.Segment) -> None:
        """Append the segment's audio (bytes: chunks already resolved), if it has any."""
        for tensor in segment.tensors:
            if tensor.name != "audio" or tensor.dtype != "float32":
                continue
            fmt = segment.audio_format
            key = (segment.request_id, stage)
            out = self.files.get(key)
            if out is None:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                name = file_stem(*key)
                out = GrowingWav(self.out_dir / f"{name}.wav", fmt.sample_rate, fmt.channels or 1)
                self.files[key] = out
            out.append(np.frombuffer(tensor.raw, dtype="<f4"))

    def paths(self, stage: str) -> list[Path]:
        return [f.path for (_, s), f in self.files.items() if s == stage]

    def close(self) -> None:
        for out in self.files.values():
            out.close()
