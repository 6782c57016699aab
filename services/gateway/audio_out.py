"""Audio out of the pipeline's speech stage, as OpenAI's clients take it.

A speech stage (one whose Describe names an "audio" output tensor: hibari's
speaker) sends a segment per sentence with a float32 mono "audio" tensor and
its ``audio_format``; large ones arrive as TensorChunks first. ``Speech``
gathers one request's samples as 16-bit PCM (the same conversion the stage's
WAV blob and ``omni generate``'s files use, ``services.mesh.wav``) and hands
them out as they come (``take``) or whole, as WAV or raw PCM.

Formats: ``wav`` (16-bit PCM WAV) and ``pcm16`` (raw 16-bit little-endian at
the stage's rate, 24 kHz for hibari); mp3, opus, aac and flac would need an
encoder the mesh does not ship, so they are refused by name.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from services.gateway.catalog import Pipeline
from services.gateway.errors import ApiError
from services.gateway.schema import ChatRequest
from services.gateway.voices import Voices
from services.mesh import wav
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.pb.omni.v1 import orchestrator_pb2

MAX_CHUNKED_BYTES = 256 << 20  # one request's audio tensors in flight as chunks
AUDIO_TTL_S = 3600  # what expires_at says; nothing is kept: it cannot be referred to later


def speech_stage(pipeline: Pipeline, param: str) -> str:
    """The pipeline's speech stage, or a 400 naming ``param`` (the field that asked)."""
    stage = pipeline.audio_stage
    if stage is None:
        raise ApiError(
            400,
            f"{param}: model {pipeline.name!r} has no stage that speaks (no audio output)",
            param=param,
            code="model_not_supported",
        )
    return stage


class Speech:
    """One request's audio from ``stage``, as 16-bit PCM."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.sample_rate = 24000  # until a segment says otherwise
        self.channels = 1
        self._pcm: list[bytes] = []
        self._taken = 0  # pieces already handed out by take()
        self._chunks = ChunkAssembler(MAX_CHUNKED_BYTES)
        self.done: orchestrator_pb2.Done | None = None

    def add(self, event: orchestrator_pb2.GenerateEvent) -> None:
        """Take the stage's audio from ``event`` (other stages' events are ignored)."""
        kind = event.WhichOneof("kind")
        if kind == "done":
            self.done = event.done
        if event.stage != self.stage:
            return
        if kind == "chunk":
            self._chunks.add(event.chunk)
            return
        if kind != "segment":
            return
        segment = event.segment
        self._chunks.resolve(segment.tensors, "segment.tensors")
        for tensor in segment.tensors:
            if tensor.name == "audio" and tensor.dtype == "float32":
                if segment.HasField("audio_format"):
                    self.sample_rate = segment.audio_format.sample_rate or self.sample_rate
                    self.channels = segment.audio_format.channels or self.channels
                self._pcm.append(wav.pcm16(np.frombuffer(tensor.raw, dtype="<f4")))

    def take(self) -> bytes:
        """The PCM that came since the last call."""
        new = b"".join(self._pcm[self._taken :])
        self._taken = len(self._pcm)
        return new

    @property
    def pcm16(self) -> bytes:
        return b"".join(self._pcm)

    def wav(self) -> bytes:
        pcm = self.pcm16
        return wav.header(self.sample_rate, self.channels, len(pcm)) + pcm

    def encoded(self, fmt: str) -> bytes:
        """All of it, as ``wav`` or as raw ``pcm16``."""
        return self.wav() if fmt == "wav" else self.pcm16


def audio_id(request_id: str) -> str:
    return "audio_" + request_id.removeprefix("chatcmpl-")


def message_audio(request_id: str, speech: Speech, fmt: str, transcript: str) -> dict[str, Any]:
    """A chat completion's ``message.audio``."""
    return {
        "id": audio_id(request_id),
        "data": base64.b64encode(speech.encoded(fmt)).decode(),
        "expires_at": int(time.time()) + AUDIO_TTL_S,
        "transcript": transcript,
    }


def ask_to_speak(
    request: orchestrator_pb2.GenerateRequest, stage: str, voice: str | None
) -> dict[str, str]:
    """Ask ``stage`` (in a whole-pipeline request) for ``voice``; returns the map
    from the speech stage's fields to the chat request's."""
    if voice is not None:
        request.stage_params[stage].extra.update({"voice": voice})
    return {"params.extra.voice": "audio.voice"}


def audio_deltas(request_id: str, speech: Speech, transcript: str) -> list[dict[str, Any]]:
    """A stream's ``delta.audio`` pieces for one event: the answer's new text as
    transcript, the audio that came since the last event as base64 pcm16."""
    pieces: list[dict[str, Any]] = []
    if transcript:
        pieces.append({"id": audio_id(request_id), "transcript": transcript})
    pcm = speech.take()
    if pcm:
        pieces.append({"id": audio_id(request_id), "data": base64.b64encode(pcm).decode()})
    return pieces


def audio_end() -> dict[str, Any]:
    """The last ``delta.audio``: only its expiry, as OpenAI's stream ends."""
    return {"expires_at": int(time.time()) + AUDIO_TTL_S}


def chat_speech(
    chat: ChatRequest,
    pipeline: Pipeline,
    request: orchestrator_pb2.GenerateRequest,
    fields: dict[str, str],
    voices: Voices,
) -> Speech | None:
    """For a chat request that asks for audio: the speech stage asked for its
    voice (``fields`` learns the stage's field names), and where its audio goes."""
    if not chat.speaks:
        return None
    stage = speech_stage(pipeline, "modalities")
    voice = voices.resolve(chat.audio.voice if chat.audio else None)
    fields.update(ask_to_speak(request, stage, voice))
    return Speech(stage)
