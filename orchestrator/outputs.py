"""Writing a request's tensor and image outputs to files (for `omni generate`)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

from orchestrator.client import Result
from services.mesh import tensors as codec

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _name(*parts: str) -> str:
    return "-".join(_SAFE.sub("_", p) for p in parts if p)


def save_outputs(result: Result, request_id: str, out_dir: Path) -> list[Path]:
    """Images as PNG, other tensors as one safetensors file per stage. No pickle."""
    written: list[Path] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for stage, produced in result.stages.items():
        for index, blob in enumerate(produced.blobs):
            if blob.media_type == "image/png":
                path = out_dir / f"{_name(request_id, stage, blob.name, str(index))}.png"
                path.write_bytes(blob.data)
                written.append(path)
        others: dict[str, torch.Tensor] = {}
        for name, pieces in produced.tensors.items():
            tensor = codec.from_proto(
                codec.concat_raw(pieces, name) if len(pieces) > 1 else pieces[0]
            )
            if _is_image(tensor) and not produced.blobs:
                path = out_dir / f"{_name(request_id, stage, name)}.png"
                Image.fromarray(tensor.numpy()).save(path)
                written.append(path)
            elif not _is_image(tensor):
                others[name] = tensor.contiguous()
        if others:
            path = out_dir / f"{_name(request_id, stage)}.safetensors"
            save_file(others, str(path))
            written.append(path)
    return written


def _is_image(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.uint8 and tensor.dim() == 3 and tensor.shape[-1] in (1, 3, 4)


def png_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return image.size
