"""Speech in, for a pipeline whose entry stage takes text only: each clip goes to
the pipeline's recogniser stage alone (``GenerateRequest.stage``, as speech out
goes to the speaker alone), once, and the conversation goes on as text.

Why at the edge, not in front of the thinker: the mesh is stateless, so each
turn sends the whole conversation; a recogniser in the request's path would hear
every past clip again each turn and would hand the thinker one user message
(the edge's ``text`` transform), losing the instructions and the history. Here
a realtime session transcribes a turn once, as it is committed (and says so in
``conversation.item.input_audio_transcription.*``), and a chat completion's
``input_audio`` parts become their transcripts before the request is sent.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import grpc
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from orchestrator.client import AsyncClient
from services.gateway.catalog import Pipeline
from services.gateway.errors import ApiError
from services.gateway.http_io import read_body
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2

# OpenAI's transcription model names, served by the recogniser like the pipeline's.
OPENAI_TRANSCRIBE = re.compile(r"whisper-1|gpt-4o(-mini)?-transcribe(-[\w.-]+)?")
FORMATS = ("json", "text", "verbose_json")  # srt/vtt need segment times the recogniser lacks
MEDIA_TYPES = {
    ".wav": "audio/wav",
    ".mp3": "audio/mpeg",
    ".mpeg": "audio/mpeg",
    ".mpga": "audio/mpeg",
    ".m4a": "audio/mp4",
    ".mp4": "audio/mp4",
    ".ogg": "audio/ogg",
    ".flac": "audio/flac",
    ".webm": "audio/webm",
}


def recogniser_stage(pipeline: Pipeline, model: str) -> str:
    """The stage that transcribes for ``model`` (the pipeline's name or an OpenAI
    transcription model): the recogniser, or an entry stage that takes audio is
    not one (it answers, it does not transcribe): 400 naming ``model``."""
    if model != pipeline.name and not OPENAI_TRANSCRIBE.fullmatch(model):
        pipeline.check_model(model)
    stage = pipeline.recogniser
    if stage is None:
        raise ApiError(
            400,
            f"model: {pipeline.name!r} has no recogniser stage (a stage after the entry "
            "that accepts audio)",
            param="model",
        )
    return stage


@dataclass
class Transcript:
    """What the recogniser said of one clip, gathered from its events."""

    on_delta: Callable[[str], None] | None = None
    text: list[str] = field(default_factory=list)
    seconds: int = 0  # the clip's length, whole seconds (the engine's prompt count)
    done: orchestrator_pb2.Done | None = None

    def add(self, event: orchestrator_pb2.GenerateEvent) -> str:
        kind = event.WhichOneof("kind")
        if kind == "segment" and event.segment.text_delta:
            delta = event.segment.text_delta
            self.text.append(delta)
            if self.on_delta is not None:
                self.on_delta(delta)
            return delta
        if kind == "completed":
            self.seconds = event.completed.usage.prompt_tokens
        elif kind == "done":
            self.done = event.done
        return ""

    @property
    def whole(self) -> str:
        return "".join(self.text).strip()


@dataclass(frozen=True)
class Upload:
    """A /v1/audio/transcriptions form, checked."""

    audio: stage_pb2.Media
    model: str
    response_format: str
    language: str | None
    prompt: str | None


FORM_FIELDS = ("file", "model", "response_format", "language", "prompt", "temperature")


async def read_form(request: Request, max_bytes: int) -> Upload:
    """The multipart form (within ``max_bytes``); each bad field refused by name."""
    body = await read_body(request, max_bytes)  # the limit first; the form is parsed from it

    async def read() -> AsyncGenerator[bytes, None]:
        yield body

    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "expected a multipart/form-data body with a file")
    parser = MultiPartParser(request.headers, read(), max_files=1, max_fields=len(FORM_FIELDS))
    try:
        form = await parser.parse()
    except (MultiPartException, ValueError) as exc:
        raise ApiError(400, f"expected a multipart form with a file: {exc}") from None
    unknown = sorted(set(form.keys()) - set(FORM_FIELDS))
    if unknown:
        raise _bad(unknown[0], f"not supported here (fields: {', '.join(FORM_FIELDS)})")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise _bad("file", "expected an audio file")
    model = form.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "expected a model name")
    response_format = str(form.get("response_format") or "json")
    if response_format not in FORMATS:
        raise _bad("response_format", f"expected one of {', '.join(FORMATS)}")
    temperature = str(form.get("temperature") or "0")
    if _number(temperature) != 0.0:
        raise _bad("temperature", "only 0 (the recogniser decodes greedily)")
    suffix = PurePath(upload.filename or "").suffix.lower()
    media_type = MEDIA_TYPES.get(suffix) or (upload.content_type or "audio/wav")
    audio = stage_pb2.Media(media_type=media_type)
    audio.data = await upload.read()
    language, prompt = form.get("language"), form.get("prompt")
    return Upload(
        audio,
        model,
        response_format,
        language if isinstance(language, str) and language else None,
        prompt if isinstance(prompt, str) and prompt else None,
    )


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param)


def response_body(transcript: Transcript, form: str, language: str | None) -> Any:
    """/v1/audio/transcriptions' answer in ``response_format``: json, text or
    verbose_json (no segment times: the recogniser reports none)."""
    if form == "text":
        return transcript.whole
    if form == "verbose_json":
        return {
            "task": "transcribe",
            "language": language or "english",
            "duration": float(transcript.seconds),
            "text": transcript.whole,
        }
    return {"text": transcript.whole}


def request(
    stage: str, audio: stage_pb2.Media, language: str | None = None, prompt: str | None = None
) -> orchestrator_pb2.GenerateRequest:
    """One clip for the recogniser alone."""
    generate = orchestrator_pb2.GenerateRequest(request_id=f"tr-{uuid.uuid4().hex}", stage=stage)
    message = generate.inputs.messages.add(role="user")
    message.parts.add().audio.CopyFrom(audio)
    extra = {k: v for k, v in (("language", language), ("prompt", prompt)) if v}
    if extra:
        generate.params.extra.update(extra)
    return generate


async def transcribe(
    client: AsyncClient,
    token: str | None,
    generate: orchestrator_pb2.GenerateRequest,
    fields: dict[str, str],
    into: Transcript | None = None,
) -> Transcript:
    """``generate``'s transcript; its failure as an ApiError naming the client's
    field (``fields`` maps the mesh's paths to it)."""
    into = into if into is not None else Transcript()
    events = client.send(generate, token=token)
    try:
        async for event in events:
            into.add(event)
    except grpc.aio.AioRpcError as exc:
        raise ApiError.from_rpc(exc) from None
    finally:
        events.cancel()
    if into.done is None:
        raise ApiError(502, "the orchestrator ended the transcription without a status")
    if into.done.code != 0:
        raise ApiError.from_done(into.done, fields)
    return into


async def spoken_parts_as_text(
    client: AsyncClient,
    token: str | None,
    pipeline: Pipeline,
    generate: orchestrator_pb2.GenerateRequest,
) -> None:
    """Each audio part of ``generate``'s messages replaced by its transcript (all
    at once), when the pipeline hears through a recogniser; left as they are
    otherwise (the entry stage takes them, or refuses them by name)."""
    stage = pipeline.recogniser
    if stage is None:
        return
    spoken = [
        (m, p, part)
        for m, message in enumerate(generate.inputs.messages)
        for p, part in enumerate(message.parts)
        if part.WhichOneof("kind") == "audio"
    ]
    if not spoken:
        return
    transcripts = await asyncio.gather(
        *(
            transcribe(
                client,
                token,
                request(stage, part.audio),
                {"inputs.messages[0].parts[0]": f"messages[{m}].content[{p}].input_audio.data"},
            )
            for m, p, part in spoken
        )
    )
    for (m, p, _), transcript in zip(spoken, transcripts, strict=True):
        generate.inputs.messages[m].parts[p].text = transcript.whole
    for m in sorted({m for m, _, _ in spoken}):
        as_text(generate.inputs.messages[m])


def as_text(message: stage_pb2.ChatMessage) -> None:
    """A message whose parts are all text as plain content, as a typed one is
    (a text-only stage reads ``content``)."""
    if all(part.WhichOneof("kind") == "text" for part in message.parts):
        texts = [part.text for part in message.parts if part.text]
        del message.parts[:]
        message.content = "\n".join(texts)
