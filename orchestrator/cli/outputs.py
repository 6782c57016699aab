"""Writing a request's tensor and image outputs to files (for `omni generate`).

Images are written with PIL straight from their bytes and other tensors with
safetensors through numpy, so a client does not pay for importing torch; only
dtypes numpy lacks (bfloat16, float8) fall back to torch. No pickle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from orchestrator.client import Result
from orchestrator.client.audio import file_stem
from services.mesh.pb.omni.v1 import tensor_pb2

_NUMPY = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
    "uint64": np.uint64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.complex64,
    "complex128": np.complex128,
}
_IMAGE_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def _joined(pieces: list[tensor_pb2.Tensor]) -> tensor_pb2.Tensor:
    """Segments' pieces of one tensor, joined along the first dim (bytes only)."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    shape = [sum(p.shape[0] for p in pieces), *first.shape[1:]]
    raw = b"".join(p.raw for p in pieces)
    return tensor_pb2.Tensor(name=first.name, dtype=first.dtype, shape=shape, raw=raw)


def _is_image(tensor: tensor_pb2.Tensor) -> bool:
    return tensor.dtype == "uint8" and len(tensor.shape) == 3 and tensor.shape[2] in _IMAGE_MODES


def save_outputs(result: Result, request_id: str, out_dir: Path) -> list[Path]:
    """PNG blobs as they are, image tensors as PNG, other tensors as one
    safetensors file per stage."""
    written: list[Path] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for stage, produced in result.stages.items():
        streamed = result.audio.paths(stage) if result.audio is not None else []
        written += streamed  # its audio, written as it came (orchestrator/client/audio.py)
        for index, blob in enumerate(produced.blobs):
            if blob.media_type == "image/png":
                path = out_dir / f"{file_stem(request_id, stage, blob.name, str(index))}.png"
                path.write_bytes(blob.data)
                written.append(path)
            elif blob.media_type == "audio/wav" and not streamed:
                path = out_dir / f"{file_stem(request_id, stage, blob.name)}.wav"
                path.write_bytes(blob.data)
                written.append(path)
        others: dict[str, tensor_pb2.Tensor] = {}
        for name, pieces in produced.tensors.items():
            if name == "audio" and streamed:
                continue
            tensor = _joined(pieces)
            if not _is_image(tensor):
                others[name] = tensor
            elif not produced.blobs:  # the PNG blob, when sent, is the same image
                height, width, channels = tensor.shape
                image = Image.frombytes(_IMAGE_MODES[channels], (width, height), tensor.raw)
                path = out_dir / f"{file_stem(request_id, stage, name)}.png"
                image.save(path)
                written.append(path)
        if others:
            path = out_dir / f"{file_stem(request_id, stage)}.safetensors"
            _save_tensors(others, path)
            written.append(path)
    return written


def _save_tensors(tensors: dict[str, tensor_pb2.Tensor], path: Path) -> None:
    if all(t.dtype in _NUMPY for t in tensors.values()):
        from safetensors.numpy import save_file as save_numpy

        arrays = {
            name: np.frombuffer(t.raw, dtype=_NUMPY[t.dtype]).reshape(tuple(t.shape))
            for name, t in tensors.items()
        }
        save_numpy(arrays, str(path))
        return
    from safetensors.torch import save_file as save_torch

    from services.mesh.tensors import codec

    save_torch({name: codec.from_proto(t) for name, t in tensors.items()}, str(path))
