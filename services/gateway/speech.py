"""/v1/audio/speech over Orchestrator.Generate: the input text goes to the
pipeline's speech stage alone (``GenerateRequest.stage``: no thinker runs), with
the voice and speed as that stage's parameters; the answer is its audio. A WAV
is sent whole (its header holds the length); raw ``pcm`` streams as each
sentence is spoken, so a player starts after the first sentence; a failure
after the first audio can only end that body early (its status is sent), and is
logged.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable

from services.gateway.audio_out import Speech
from services.gateway.schema import SpeechRequest
from services.gateway.voices import Voices
from services.mesh import wav
from services.mesh.pb.omni.v1 import orchestrator_pb2

logger = logging.getLogger(__name__)

MEDIA_TYPES = {"wav": wav.MEDIA_TYPE, "pcm": "audio/pcm"}


def generate_request(
    speech: SpeechRequest, stage: str, voices: Voices
) -> tuple[orchestrator_pb2.GenerateRequest, dict[str, str]]:
    """The GenerateRequest for ``stage`` alone, and the map from the stage's
    field paths to the request's."""
    request = orchestrator_pb2.GenerateRequest(request_id=f"speech-{uuid.uuid4().hex}", stage=stage)
    request.inputs.text = speech.input
    extra: dict[str, object] = {}
    voice = voices.resolve(speech.voice)
    if voice is not None:  # an alias of the default asks for none
        extra["voice"] = voice
    if speech.speed is not None:
        extra["speed"] = speech.speed
    request.params.extra.update(extra)
    fields = {
        "inputs": "input",
        "params.extra.voice": "voice",
        "params.extra.speed": "speed",
        "request_id": "",
        "stage": "",
    }
    return request, fields


async def pcm_body(
    said: Speech, events: AsyncIterator[orchestrator_pb2.GenerateEvent]
) -> AsyncIterator[bytes]:
    """The stage's audio as raw 16-bit PCM, each piece as it comes."""
    async for event in events:
        said.add(event)
        pcm = said.take()
        if pcm:
            yield pcm
    done = said.done
    if done is not None and done.code != 0:
        logger.warning(
            "request %s: %s %s (the audio ends early)",
            done.request_id,
            done.code_name,
            done.message,
        )


def pcm_stream(
    said: Speech,
) -> Callable[[AsyncIterator[orchestrator_pb2.GenerateEvent]], AsyncIterator[bytes]]:
    return lambda events: pcm_body(said, events)
