"""/v1/chat/completions over Orchestrator.Generate: the request's messages and
sampling fields become one GenerateRequest for the entry stage; the pipeline's
events become a completion, or OpenAI's ``chat.completion.chunk`` stream.

The answer's text is that of the first stage to stream text (the thinker of the
default pipeline), and ``usage`` and ``finish_reason`` come from that stage's
Completed. Other stages still run (a renderer draws its image); their outputs
are not part of a chat completion, except a speech stage's audio when
``modalities`` asks for it (audio_out.py): then the text is the audio's
transcript, as OpenAI gives it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson

from services.gateway import content
from services.gateway.audio_out import Speech, audio_deltas, audio_end, message_audio
from services.gateway.errors import ApiError
from services.gateway.schema import ChatRequest
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system prompt
# The mesh's finish reasons (services/mesh/finish.py) in OpenAI's words: its model
# ending the answer, a stop string and a whole output are all a "stop"; vLLM's own
# OpenAI server passes an abort on as "abort", and so do we (docs/api.md).
FINISH: dict[str, str] = {  # keys: every FinishReason (tests/gateway/test_finish.py)
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "done": "stop",
    "abort": "abort",
}
DONE = b"data: [DONE]\n\n"


def generate_request(chat: ChatRequest) -> tuple[orchestrator_pb2.GenerateRequest, dict[str, str]]:
    """The GenerateRequest for ``chat``, and the map from the mesh's field paths
    back to the request's fields (for errors that name one)."""
    request = orchestrator_pb2.GenerateRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}")
    for index, message in enumerate(chat.messages):
        role = _ROLES.get(message.role, message.role)
        request.inputs.messages.add().CopyFrom(content.chat_message(role, message, index))
    params = request.params
    max_tokens = chat.max_completion_tokens or chat.max_tokens
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if chat.temperature is not None:
        params.temperature = chat.temperature
    if chat.top_p is not None:
        params.top_p = chat.top_p
    if chat.seed is not None:
        params.seed = chat.seed
    params.stop.extend(chat.stops)
    fields = {
        "inputs": "messages",
        "params.max_tokens": chat.max_tokens_field,
        "params.temperature": "temperature",
        "params.top_p": "top_p",
        "params.seed": "seed",
        "params.stop": "stop",
        "request_id": "",  # ours, not the caller's
        **content.fields(chat),  # a content part's field, as the request spelt it
    }
    return request, fields


@dataclass
class Answer:
    """What a chat completion reports, gathered from the pipeline's events."""

    stage: str = ""  # the stage whose text is the answer: the first to stream text
    text: list[str] = field(default_factory=list)
    completions: dict[str, stage_pb2.Completed] = field(default_factory=dict)
    done: orchestrator_pb2.Done | None = None
    speech: Speech | None = None  # the speech stage's audio, when asked for

    def add(self, event: orchestrator_pb2.GenerateEvent) -> str:
        """Take one event; returns the answer's new text in it ("" if none)."""
        if self.speech is not None:
            self.speech.add(event)
        kind = event.WhichOneof("kind")
        if kind == "segment":
            delta = event.segment.text_delta
            if delta and not self.stage:
                self.stage = event.stage
            if delta and event.stage == self.stage:
                self.text.append(delta)
                return delta
        elif kind == "completed":
            self.completions.setdefault(event.stage, event.completed)
        elif kind == "done":
            self.done = event.done
        return ""

    @property
    def completed(self) -> stage_pb2.Completed | None:
        """The text stage's Completed (with no text at all, the first stage's)."""
        if self.stage:
            return self.completions.get(self.stage)
        return next(iter(self.completions.values()), None)

    @property
    def finish_reason(self) -> str:
        completed = self.completed
        # A stage of another version may say a reason this gateway does not know yet.
        reason = completed.finish_reason if completed is not None else ""
        return FINISH.get(reason, "stop")

    @property
    def usage(self) -> dict[str, int]:
        completed = self.completed
        usage = completed.usage if completed is not None else stage_pb2.Usage()
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }


def completion(
    request_id: str, model: str, answer: Answer, audio_format: str = "wav"
) -> dict[str, Any]:
    """The ``chat.completion`` object of a request that succeeded."""
    text = "".join(answer.text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if answer.speech is not None:
        message = {
            "role": "assistant",
            "content": None,
            "audio": message_audio(request_id, answer.speech, audio_format, text),
        }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": answer.finish_reason,
            }
        ],
        "usage": answer.usage,
    }


class ChunkStream:
    """One request's events as server-sent ``chat.completion.chunk`` events: the
    role first, then each piece of the answer's text as it comes, the finish
    reason at the Done (usage too, with ``stream_options.include_usage``), then
    ``data: [DONE]``. A request that fails after the stream began gets an
    ``error`` event in OpenAI's shape before ``[DONE]``."""

    def __init__(
        self,
        request_id: str,
        model: str,
        fields: dict[str, str],
        *,
        include_usage: bool,
        speech: Speech | None = None,
    ) -> None:
        self.answer = Answer(speech=speech)
        self._fields = fields
        self._include_usage = include_usage
        self._head = {"id": request_id, "object": "chat.completion.chunk", "model": model}
        self._created = int(time.time())

    async def sse(
        self, events: AsyncIterator[orchestrator_pb2.GenerateEvent]
    ) -> AsyncIterator[bytes]:
        speech = self.answer.speech
        yield self._chunk({"role": "assistant", "content": None if speech else ""})
        try:
            async for event in events:
                delta = self.answer.add(event)
                if speech is not None:
                    for piece in audio_deltas(self._head["id"], speech, delta):
                        yield self._chunk({"audio": piece})
                elif delta:
                    yield self._chunk({"content": delta})
        except grpc.aio.AioRpcError as exc:  # ended without a Done: the orchestrator went away
            yield _event(ApiError.from_rpc(exc).body)
            yield DONE
            return
        done = self.answer.done
        if done is not None and done.code != 0:
            yield _event(ApiError.from_done(done, self._fields).body)
        elif done is not None:
            if speech is not None:
                yield self._chunk({"audio": audio_end()})
            yield self._chunk({}, self.answer.finish_reason)
            if self._include_usage:
                yield _event({**self._base(), "choices": [], "usage": self.answer.usage})
        yield DONE

    def _base(self) -> dict[str, Any]:
        return {**self._head, "created": self._created}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _event({**self._base(), "choices": [choice]})


def _event(data: dict[str, Any]) -> bytes:
    # orjson: a fraction of the standard json's time a chunk, once per text piece
    # (docs/benchmarks.md)
    return b"data: " + orjson.dumps(data) + b"\n\n"
