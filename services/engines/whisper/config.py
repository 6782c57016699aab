"""The recogniser's settings (``engine_args``) and a request's audio limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.engines.engine_args import EngineArgs


class WhisperArgs(EngineArgs):
    """``compute_type``: CTranslate2's weights and arithmetic (int8 on a CPU;
    float16 on a GPU). ``beam_size`` 1 is greedy: a turn's latency over a point
    of accuracy. ``language``: what the audio is taken to be (an English-only
    model knows only "en"; None lets a multilingual one detect it).
    ``max_audio_s``: the longest clip one request may hold (Whisper reads 30 s
    windows; a longer clip is read window by window). ``min_peak``: a clip whose
    loudest sample is under this is silence, refused rather than transcribed
    into Whisper's guesses. ``threads``: CTranslate2's intra-op threads, per
    clip. ``workers``: clips transcribed at once, each on its own model replica
    (CTranslate2's workers share the weights); turns that end together, as several
    sessions' do, are heard side by side instead of one after another.
    ``fitted_window``: a clip of up to 25 s is read in a window of its length
    plus 5 s instead of Whisper's 30 s, and again in the 30 s window when that
    answer looks wrong (fitted.py): ~4x less encoder time for a spoken question."""

    compute_type: Literal["int8", "int8_float32", "float32", "float16", "int8_float16"] = "int8"
    beam_size: int = Field(1, ge=1, le=10)
    language: str | None = "en"
    max_audio_s: float = Field(120.0, gt=0)
    min_peak: float = Field(1e-3, ge=0.0, lt=1.0)
    threads: int = Field(1, ge=1)
    workers: int = Field(1, ge=1)
    fitted_window: bool = True
