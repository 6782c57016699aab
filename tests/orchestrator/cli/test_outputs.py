from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch

from orchestrator.cli.outputs import save_outputs
from orchestrator.client import Result, StageResult
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


def test_audio_segments_grow_one_wav_named_by_request_and_stage(tmp_path: Path) -> None:
    """``<id>-<stage>.wav``: an id's dashes and dots stay, a slash cannot leave the
    folder; the pieces join in order into one valid WAV."""
    import wave

    from orchestrator.client.audio import AudioFiles
    from services.mesh.pb.omni.v1 import stage_pb2

    files = AudioFiles(tmp_path)
    pieces = [np.linspace(-0.5, 0.5, n, dtype=np.float32) for n in (100, 37)]
    for request_id in ("sea-1.a", "../up"):
        for piece in pieces:
            segment = stage_pb2.Segment(request_id=request_id)
            segment.audio_format.sample_rate = 24_000
            segment.audio_format.channels = 1
            segment.tensors.append(codec.to_proto(torch.from_numpy(piece), "audio"))
            files.add("speaker", segment)
    files.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".._up-speaker.wav", "sea-1.a-speaker.wav"]
    with wave.open(str(tmp_path / "sea-1.a-speaker.wav")) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getnframes()) == (24_000, 1, 137)
