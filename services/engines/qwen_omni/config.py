"""The settings (``engine_args``) of the three Qwen3-Omni engines, and the names
of the tensors that travel between them."""

from __future__ import annotations

from pydantic import Field

from services.engines.engine_args import EngineArgs

# thinker -> talker, on a windowed edge or whole (window -1): right after its prefill
# the thinker sends the prompt's part as one tokenless segment: the prompt's hidden
# states [prompt, 2, hidden] (layer 0, the embeddings, then the talker's
# accept_hidden_layer), its ids, the thinker's embeddings of tts_bos, tts_eos and
# tts_pad [3, hidden], and for images and audio the grid and feature lengths the
# talker's 3D positions need; then each answer token with its layer-0 row (its
# embedding) as per-token "hidden_states" [1, hidden], which windows split with the
# tokens. Names ending in "hidden_states" reach no client that did not ask.
HIDDEN = "hidden_states"
PROMPT_HIDDEN = "prompt_hidden_states"
PROMPT_IDS = "prompt_ids"
TTS_EMBEDS = "tts_embeds"
IMAGE_GRID = "image_grid_thw"
AUDIO_LENGTHS = "audio_feature_lengths"
HANDOFF = (HIDDEN, PROMPT_HIDDEN, PROMPT_IDS, TTS_EMBEDS, IMAGE_GRID, AUDIO_LENGTHS)
# talker -> code2wav: the codec codes of one step per segment, [1, num_code_groups]
# int64, rows in time order (a window joins steps along the first dim).
CODES = "codes"


class ThinkerArgs(EngineArgs):
    """``handoff``: emit the talker's tensors at the end of each answer (off for a
    thinker that only writes text). ``max_media_bytes``: the most encoded media
    one request may carry into the processor."""

    handoff: bool = True
    max_media_bytes: int = Field(32 << 20, ge=1)


class TalkerArgs(EngineArgs):
    """The talker's sampling, as the monolithic ``generate`` sets it (its
    ``talker_*`` arguments); a request's temperature 0 makes it greedy (the code
    predictor follows). ``thinker_eos_token_id``: the thinker's end token (None:
    the checkpoint's im_end), where the talker is told the text ends."""

    speaker: str = "ethan"
    max_new_tokens: int = Field(4096, ge=1)
    temperature: float = Field(0.9, ge=0)
    top_k: int = Field(50, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    repetition_penalty: float = Field(1.05, gt=0)
    thinker_eos_token_id: int | None = None


class Code2WavArgs(EngineArgs):
    """``chunk_size`` codes are decoded at a time, each with ``left_context_size``
    codes before it, as ``code2wav.chunked_decode`` does (the monolithic model uses
    300 and 25): the joined audio equals chunked_decode's with the same two
    numbers, whatever windows the codes arrive in. A smaller chunk gives the first
    audio sooner. ``sample_rate``: of the waveform (24 kHz for Qwen3-Omni)."""

    chunk_size: int = Field(300, ge=1)
    left_context_size: int = Field(25, ge=0)
    sample_rate: int = Field(24000, ge=1)
    max_streams: int = Field(64, ge=1)
