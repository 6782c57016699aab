"""benchmarks/first_audio.py's tiny_omni case runs end to end: one round of
both arms (talker → code2wav at window -1 and at code2wav's chunk_size) over
real stage processes, the same audio from both (the runner refuses a result
whose arms differ), made of every code the talker sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._audio_cases import tiny_omni
from benchmarks._omni import TINY_CHUNK
from benchmarks.first_audio import run

CODES = 40  # max_tokens: the talker's last step makes no residual codes, so 39 arrive


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_tiny_omni_case_both_arms_same_audio(tmp_path: Path) -> None:
    case = tiny_omni(str(tmp_path), CODES)
    result = await run(case, runs=1)
    assert result["same_text_and_audio"] and len(result["audio_sha256"]) == 64
    assert result["audio_stage_fed"] == f"{CODES - 1} codes"
    full, windowed = result["raw"]["full"][0], result["raw"]["windowed"][0]
    # Each chunk of TINY_CHUNK codes is one audio segment, however the edge windowed them.
    chunks = -(-(CODES - 1) // TINY_CHUNK)
    assert len(full["pieces"]) == len(windowed["pieces"]) == chunks
    # Played at the real codec's length, 80 ms a code, less what each chunk's decode
    # trims (code2wav's own chunked_decode: 6 of the tiny model's 8 samples a code).
    assert (CODES - 1) * 0.08 - chunks * 6 * result["play_scale"] / 24000 == pytest.approx(
        result["audio_s"]
    )
