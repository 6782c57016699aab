"""`omni up examples/pipelines/qwen3-omni.yaml --prompt … --image FILE` as a user
runs it on this machine: the tiny checkpoint is built in the cache by the stages
themselves (load_format dummy), the answer is printed and a WAV is written."""

from __future__ import annotations

import asyncio
import os
import sys
import wave
from pathlib import Path

from tests.engines.qwen_omni.reference import png

REPO = Path(__file__).resolve().parents[3]
OMNI = str(Path(sys.executable).parent / "omni")


async def test_omni_up_answers_with_text_and_a_wav(tmp_path: Path) -> None:
    image = tmp_path / "picture.png"
    image.write_bytes(png())
    out = tmp_path / "out"
    up = await asyncio.create_subprocess_exec(
        OMNI, "up", str(REPO / "examples/pipelines/qwen3-omni.yaml"), "--port", "0",
        "--prompt", "What is this?", "--image", str(image), "--out", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "OMNI_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    printed, _ = await asyncio.wait_for(up.communicate(), 300)
    text = printed.decode(errors="replace")
    assert up.returncode == 0, text
    assert "[thinker]" in text
    (wav_file,) = out.glob("*-code2wav.wav")
    with wave.open(str(wav_file)) as clip:
        assert clip.getframerate() == 24000 and clip.getnframes() > 0
    assert (tmp_path / "cache" / "qwen3-omni-tiny-seed0" / "model.safetensors").is_file()
