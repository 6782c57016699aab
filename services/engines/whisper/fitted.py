"""Reading a short clip in a window fitted to it instead of Whisper's 30 s.

Whisper's encoder reads 30 s windows (3,000 mel frames), a short clip padded
with quiet; its cost follows the window, not the speech: on one CPU thread
tiny.en's encoder takes ~0.9 s for 30 s and ~0.2 s for 8 s. CTranslate2's
encoder takes any even number of frames, so a clip of up to ``MAX_FITTED_S`` is
read in a window of its own length plus ``QUIET_S`` of quiet (without that tail
the decoder tends to start the sentence again: measured below), greedy or beam
as configured, text only (no timestamps), its token budget scaled to its length.

Whisper was trained on 30 s windows, so the answer is checked: one that is cut
off by its budget, or repeats a phrase of ``REPEAT_WORDS`` words (the fitted
window's failure mode), or whose tokens are unlikely on average, is read again
in the full window by the caller. Measured with benchmarks/voice_turn.py's 25
sentences in two voices, clean and at 10 dB SNR (tiny.en, int8, one thread):
word error rate 0.016-0.073 against 0.016-0.081 for the full window, ~0.2 s a
clip against ~0.9 s (docs/benchmarks.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_FITTED_S = 25.0  # longer clips go as Whisper reads them: 30 s windows
QUIET_S = 5.0  # quiet after the speech, in the window
FULL_FRAMES = 3000  # Whisper's window: 30 s at 100 frames a second
TOKENS_PER_S = 6.0  # the token budget: speech runs ~3 words (~4 tokens) a second
EXTRA_TOKENS = 8
REPEAT_WORDS = 4  # a phrase this long said twice in one short clip: read it again
MIN_AVG_LOGPROB = -1.0  # faster-whisper's own threshold for a doubtful decode


@dataclass(frozen=True)
class Heard:
    """What a fitted window heard, shaped as faster-whisper's segments are read."""

    text: str
    tokens: list[int]


def fits(clip: np.ndarray) -> bool:
    return len(clip) <= MAX_FITTED_S * 16000


def hear(
    model: Any, clip: np.ndarray, language: str | None, prompt: str | None, beam_size: int
) -> Heard | None:
    """``clip`` (16 kHz) read in a fitted window by ``model`` (a faster-whisper
    WhisperModel); None when the answer looks wrong and the full window should read
    it, or when the language must be detected (done on the full window)."""
    from faster_whisper.tokenizer import Tokenizer
    from faster_whisper.transcribe import get_suppressed_tokens

    multilingual = bool(model.model.is_multilingual)
    if multilingual and language is None:
        return None
    tokenizer = Tokenizer(model.hf_tokenizer, multilingual, task="transcribe", language=language)
    features = model.feature_extractor(clip)
    frames = min(FULL_FRAMES, features.shape[-1] + int(QUIET_S * 100))
    frames += frames % 2  # the encoder's first convolution strides by two
    window = np.zeros((features.shape[0], frames), dtype=np.float32)  # 0 is quiet here
    used = min(frames, features.shape[-1])
    window[:, :used] = features[:, :used]
    earlier = tokenizer.encode(" " + prompt.strip()) if prompt else []
    start = model.get_prompt(tokenizer, earlier, without_timestamps=True)
    budget = EXTRA_TOKENS + int(TOKENS_PER_S * len(clip) / 16000)
    result = model.model.generate(
        model.encode(window),
        [start],
        beam_size=beam_size,
        max_length=len(start) + budget,
        return_scores=True,
        suppress_blank=True,
        suppress_tokens=get_suppressed_tokens(tokenizer, [-1]),
    )[0]
    tokens = list(result.sequences_ids[0])
    text = tokenizer.decode(tokens)
    # CTranslate2's score is the log-probability over the length; faster-whisper's
    # average counts the end token too.
    average = result.scores[0] * len(tokens) / (len(tokens) + 1)
    if len(tokens) >= budget or repeats(text) or average < MIN_AVG_LOGPROB:
        return None
    return Heard(text, tokens)


def repeats(text: str) -> bool:
    """Some phrase of ``REPEAT_WORDS`` words said twice."""
    words = re.findall(r"[\w']+", text.lower())
    seen: set[tuple[str, ...]] = set()
    for i in range(len(words) - REPEAT_WORDS + 1):
        phrase = tuple(words[i : i + REPEAT_WORDS])
        if phrase in seen:
            return True
        seen.add(phrase)
    return False
