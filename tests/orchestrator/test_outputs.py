from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch

from orchestrator.client import Result, StageResult
from orchestrator.outputs import save_outputs
from services.mesh.tensors import codec


def test_images_become_pngs_and_other_tensors_safetensors(tmp_path: Path) -> None:
    image = torch.arange(4 * 5 * 3, dtype=torch.uint8).reshape(4, 5, 3)
    rows = torch.randn(5, 8)
    result = Result(
        stages={
            "renderer": StageResult(tensors={"image": [codec.to_proto(image, "image")]}),
            "thinker": StageResult(
                tensors={
                    "hidden_states": [
                        codec.to_proto(rows[:2], "hidden_states"),
                        codec.to_proto(rows[2:], "hidden_states"),
                    ]
                }
            ),
        }
    )
    written = save_outputs(result, "r1", tmp_path)
    assert sorted(p.name for p in written) == ["r1-renderer-image.png", "r1-thinker.safetensors"]
    png = np.asarray(Image.open(tmp_path / "r1-renderer-image.png"))
    assert png.shape == (4, 5, 3) and np.array_equal(png, image.numpy())
    saved = load_numpy(str(tmp_path / "r1-thinker.safetensors"))["hidden_states"]
    assert np.array_equal(saved, rows.numpy())  # the segments' pieces, joined in order


def test_bfloat16_goes_through_torch(tmp_path: Path) -> None:
    hidden = torch.randn(3, 4, dtype=torch.bfloat16)
    result = Result(stages={"thinker": StageResult(tensors={"h": [codec.to_proto(hidden, "h")]})})
    (path,) = save_outputs(result, "bf", tmp_path)
    assert torch.equal(load_torch(str(path))["h"], hidden)
