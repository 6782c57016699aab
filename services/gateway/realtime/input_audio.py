"""A session's input audio buffer: the 16-bit 24 kHz PCM appended and not yet
committed, where it sits in all the audio the session has heard (server VAD's
times count from the session's start, as OpenAI's do), server VAD over it
(vad.py) and the turn it is hearing. A commit takes the buffer out whole,
checked here: a pipeline that cannot hear clears it, under ``MIN_COMMIT_MS`` is
refused and kept. The session makes the item and says what happened."""

from __future__ import annotations

import asyncio

from services.gateway.catalog import Pipeline
from services.gateway.realtime import client_events as ce
from services.gateway.realtime.conversation import new_id
from services.gateway.realtime.session_config import RATE, SemanticVadSettings, ServerVadSettings
from services.gateway.realtime.vad import ServerVad, Turn

BYTES_PER_MS = RATE * 2 // 1000
MIN_COMMIT_MS = 100  # as OpenAI's: a shorter buffer is refused


class InputAudioBuffer:
    def __init__(self, detection: ServerVadSettings | SemanticVadSettings | None) -> None:
        self._pcm = bytearray()
        self._before = 0  # bytes of the session's audio before the buffer's first
        self.vad = ServerVad(detection) if detection is not None else None
        self.turn_item = ""  # the item id of the turn server VAD is hearing
        self._turn_start_ms = 0  # where it started, in the session's audio

    def __len__(self) -> int:
        return len(self._pcm)

    def detect(self, detection: ServerVadSettings | SemanticVadSettings | None) -> None:
        """Server VAD anew with ``detection`` (None: off)."""
        # Its times count the session's audio from the start, as OpenAI's do.
        heard = (self._before + len(self._pcm)) // BYTES_PER_MS
        self.vad = ServerVad(detection, heard) if detection is not None else None

    async def append(self, pcm: bytes, limit: int) -> list[Turn]:
        """``pcm`` at the buffer's end (which holds at most ``limit`` bytes); the
        turns server VAD hears start or stop in it."""
        if len(self._pcm) + len(pcm) > limit:
            raise ce.bad(
                "audio",
                f"the input audio buffer holds at most {limit} bytes "
                f"({len(self._pcm)} now): commit or clear it",
                "audio_buffer_full",
            )
        self._pcm += pcm
        if self.vad is None:
            return []
        # Scored off the event loop: a long append is many frames.
        return await asyncio.to_thread(self.vad.feed, pcm)

    def start_turn(self, ms: int) -> str:
        """Server VAD heard a turn start at ``ms``: the id its item will have."""
        self.turn_item = new_id("item")
        self._turn_start_ms = ms
        return self.turn_item

    def turn_skip(self, prefix_padding_ms: int) -> int:
        """The bytes at the buffer's head before the turn's padding: silence, left
        out of the item (from where the turn started, not where it stopped)."""
        start = (self._turn_start_ms - prefix_padding_ms) * BYTES_PER_MS
        return max(0, start - self._before)

    def heard(self, skip: int = 0) -> bytes:
        """The buffer's audio so far (less its first ``skip`` bytes), left in it."""
        return bytes(self._pcm[skip:])

    def commit(self, pipeline: Pipeline, *, skip: int = 0) -> bytes:
        """The buffer's audio (less its first ``skip`` bytes) as one turn, taken out."""
        pcm = bytes(self._pcm[skip:])
        entry = pipeline.entry
        if not pipeline.hears:
            self.clear()
            kinds = ", ".join(entry.accepts) or "text"
            raise ce.bad(
                "input_audio_buffer",
                f"the pipeline's entry stage {entry.name!r} accepts "
                f"{kinds}, not audio (the buffer was cleared)",
                "audio_not_supported",
            )
        if len(pcm) < MIN_COMMIT_MS * BYTES_PER_MS:
            raise ce.bad(
                "input_audio_buffer",
                f"expected at least {MIN_COMMIT_MS} ms of audio, got {len(pcm) // BYTES_PER_MS} ms",
                "input_audio_buffer_commit_empty",
            )
        self.clear()
        return pcm

    def clear(self) -> None:
        self._before += len(self._pcm)
        self._pcm.clear()
