"""A client's conversation item, part by part, as the session keeps it: which
parts each role may hold, audio checked (base64 16-bit PCM at 24 kHz, within
the buffer's limit, and only if the pipeline hears: its entry stage takes audio
or a recogniser stage transcribes it), an
assistant's audio kept as its transcript."""

from __future__ import annotations

from services.gateway.catalog import Pipeline
from services.gateway.realtime import client_events as ce
from services.gateway.realtime.conversation import Part

_KINDS = {
    "user": ("input_text", "input_audio"),
    "system": ("input_text",),
    "assistant": ("output_text", "output_audio", "text", "audio"),
}


def part_of(
    role: str,
    part: ce.ContentPart,
    where: str,
    pipeline: Pipeline,
    audio_limit: int,
) -> Part:
    """``part`` (the client's ``where``) of a ``role`` item; errors name the field."""
    kinds = _KINDS[role]
    if part.type not in kinds:
        raise ce.bad(f"{where}.type", f"a {role} item's parts are {', '.join(kinds)}")
    if part.type == "input_audio":
        if part.audio is None:
            raise ce.bad(f"{where}.audio", "expected base64 16-bit PCM at 24 kHz")
        if not pipeline.hears:
            entry = pipeline.entry
            accepted = ", ".join(entry.accepts) or "text"
            message = f"the pipeline's entry stage {entry.name!r} accepts {accepted}, not audio"
            raise ce.bad(where, message, "audio_not_supported")
        pcm = ce.pcm(part.audio, f"{where}.audio", audio_limit)
        if not pcm:
            raise ce.bad(f"{where}.audio", "empty")
        return Part("input_audio", text=part.transcript or "", pcm=pcm)
    text = part.text if part.type in ("input_text", "output_text", "text") else part.transcript
    if text is None:
        field = "transcript" if part.type in ("output_audio", "audio") else "text"
        raise ce.bad(f"{where}.{field}", "expected a string")
    kind = {"text": "output_text", "audio": "output_audio"}.get(part.type, part.type)
    return Part(kind, text=text)
