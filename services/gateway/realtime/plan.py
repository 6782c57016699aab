"""What one ``response.create`` sends the mesh: the session's settings under the
response's own, the conversation within its budget as chat messages (the
instructions first, as a system message), and the speech stage asked for the
voice (an OpenAI voice name is the stage's default: voices.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.gateway.audio_out import speech_stage
from services.gateway.realtime import client_events as ce
from services.gateway.realtime.response import Plan, response_id
from services.gateway.realtime.session_config import AudioOutput
from services.gateway.schema import validate
from services.mesh.pb.omni.v1 import orchestrator_pb2

if TYPE_CHECKING:
    from services.gateway.realtime.session import Session


def plan_response(session: Session, params: ce.ResponseParams) -> Plan:
    config = session.config
    pipeline = session.pipeline
    modalities = params.output_modalities or config.output_modalities
    speaks = modalities == ["audio"]
    field = (
        "response.output_modalities" if params.output_modalities else "session.output_modalities"
    )
    stage = speech_stage(pipeline, field) if speaks else None
    output = config.audio.output
    if params.audio is not None and params.audio.output:
        merged = {**output.model_dump(mode="json"), **params.audio.output}
        output = validate(AudioOutput, merged, prefix="response.audio.output")
    max_tokens = (
        params.max_output_tokens
        if params.max_output_tokens is not None
        else config.max_output_tokens
    )
    instructions = params.instructions if params.instructions is not None else config.instructions

    sent = session.trimmed()
    if not (sent or instructions):
        # With instructions and no item yet the model speaks first, as OpenAI's does
        # (a voice agent's greeting); with neither there is nothing to answer.
        raise ce.bad(
            "type",
            "the conversation is empty and there are no instructions: create an item, "
            "commit audio or set instructions first",
            "conversation_empty",
        )

    request = orchestrator_pb2.GenerateRequest(request_id=response_id())
    request.outputs.extend(pipeline.outputs(audio=stage is not None))  # never an image
    if instructions:
        request.inputs.messages.add(role="system", content=instructions)
    hears = "audio" in pipeline.entry.accepts
    for item in sent:
        request.inputs.messages.add().CopyFrom(item.message(audio=hears))
    if max_tokens != "inf":
        request.params.max_tokens = int(max_tokens)
    source = "response" if params.audio is not None and params.audio.output else "session"
    fields = {
        "inputs": "item",
        "params.max_tokens": ("response" if params.max_output_tokens is not None else "session")
        + ".max_output_tokens",
        "params.extra.voice": f"{source}.audio.output.voice",
        "params.extra.speed": f"{source}.audio.output.speed",
        "request_id": "",
    }
    if stage is not None:
        extra: dict[str, object] = {}
        voice = session.context.voices.resolve(output.voice)
        if voice is not None:
            extra["voice"] = voice
        if output.speed != 1.0:
            extra["speed"] = output.speed
        if extra:
            request.stage_params[stage].extra.update(extra)
    return Plan(request, fields, sent, stage, output.voice, max_tokens, params.metadata)


def refill(plan: Plan, audio: bool) -> None:
    """The plan's conversation again, once the transcripts it waited for are in."""
    messages = plan.request.inputs.messages
    first = len(messages) - len(plan.sent)
    for k, item in enumerate(plan.sent):
        messages[first + k].CopyFrom(item.message(audio=audio))
