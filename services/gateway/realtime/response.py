"""One response of a realtime session: the conversation sent to the mesh as one
GenerateRequest, and its events back as the response's server events. The
first stage to stream text (the thinker) is the answer's text, or with audio
out its transcript; the speech stage's audio goes out as base64 16-bit PCM
deltas, each as it is spoken.

Cancelling a response (``response.cancel``, or speech starting under server
VAD) cancels its task: the task stops reading, cancels the mesh request (the
orchestrator aborts it in every stage) and ends with ``response.done``,
``cancelled``. Every event of the response is queued by its task alone, in
order, so no delta of it can follow that ``response.done``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from services.gateway.audio_out import Speech
from services.gateway.chat import Answer
from services.gateway.errors import ApiError
from services.gateway.realtime import wire
from services.gateway.realtime.conversation import Conversation, Item, Part, new_id
from services.mesh.pb.omni.v1 import orchestrator_pb2

logger = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]


class Events(Protocol):
    """A request's events from the mesh (``AsyncClient.send``), cancellable."""

    def __aiter__(self) -> AsyncIterator[orchestrator_pb2.GenerateEvent]: ...

    def cancel(self) -> None: ...


@dataclass(frozen=True)
class Plan:
    """What a response was asked for, settled before it starts."""

    request: orchestrator_pb2.GenerateRequest
    fields: dict[str, str]  # the mesh's field paths -> the client's, for errors
    sent: list[Item]  # the conversation as sent
    speech_stage: str | None  # where audio comes from (None: text out)
    voice: str  # as the client named it
    max_output_tokens: int | str
    metadata: dict[str, str] | None

    @property
    def modalities(self) -> list[str]:
        return ["audio"] if self.speech_stage else ["text"]


class Response:
    def __init__(self, plan: Plan, conversation: Conversation, emit: Emit) -> None:
        self.plan = plan
        self.id = plan.request.request_id
        self._conversation = conversation
        self._emit = emit
        self._speaks = plan.speech_stage is not None
        self.answer = Answer(speech=Speech(plan.speech_stage) if plan.speech_stage else None)
        self.item: Item | None = None
        self._text: list[str] = []
        self._cancel_reason = ""
        self._started = False
        self.task: asyncio.Task[None] | None = None

    def start(self, events: Events) -> asyncio.Task[None]:
        self._emit({"type": "response.created", "response": self._view("in_progress")})
        self.task = asyncio.create_task(self._run(events), name=f"realtime {self.id}")
        return self.task

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    def cancel(self, reason: str) -> None:
        """``client_cancelled`` or ``turn_detected``; the task ends the response. A
        task not started yet sees the reason as it starts (a cancel thrown into
        it before its first step would skip its response.done)."""
        if self.task is None or self.task.done() or self._cancel_reason:
            return
        self._cancel_reason = reason
        if self._started:
            self.task.cancel()

    async def _run(self, events: Events) -> None:
        self._started = True
        status, details = "completed", None
        try:
            if self._cancel_reason:
                raise asyncio.CancelledError
            async for event in events:
                self._take(event)
            status, details = self._outcome()
        except asyncio.CancelledError:
            status, details = "cancelled", {"type": "cancelled", "reason": self._cancel_reason}
        except grpc.aio.AioRpcError as exc:  # ended without a Done: the orchestrator went away
            status, details = self._failed(ApiError.from_rpc(exc))
        finally:
            events.cancel()  # a no-op once the call has ended
        self._finish(status, details)

    def _take(self, event: orchestrator_pb2.GenerateEvent) -> None:
        delta = self.answer.add(event)
        speech = self.answer.speech
        pcm = speech.take() if speech is not None else b""
        if not (delta or pcm):
            return
        item = self.item or self._open()
        where = {"response_id": self.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        if delta:
            self._text.append(delta)
            kind = (
                "response.output_audio_transcript.delta"
                if self._speaks
                else "response.output_text.delta"
            )
            self._emit({"type": kind, **where, "delta": delta})
        if pcm:
            item.parts[0].audio_bytes += len(pcm)
            audio = base64.b64encode(pcm).decode()
            self._emit({"type": "response.output_audio.delta", **where, "delta": audio})

    def _open(self) -> Item:
        """The answer's item, added to the conversation as its first output comes."""
        part = Part("output_audio" if self._speaks else "output_text")
        item = self.item = Item("assistant", [part], status="in_progress")
        previous = self._conversation.add(item)
        view = item.view()
        self._emit(
            {
                "type": "response.output_item.added",
                "response_id": self.id,
                "output_index": 0,
                "item": view,
            }
        )
        self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": view})
        self._emit(
            {
                "type": "response.content_part.added",
                "response_id": self.id,
                "item_id": item.id,
                "output_index": 0,
                "content_index": 0,
                "part": self._part_view(""),
            }
        )
        return item

    def _part_view(self, text: str) -> dict[str, Any]:
        return (
            {"type": "audio", "transcript": text}
            if self._speaks
            else {"type": "text", "text": text}
        )

    def _outcome(self) -> tuple[str, dict[str, Any] | None]:
        done = self.answer.done
        if done is None:
            return self._failed(
                ApiError(502, "the orchestrator ended the request without a status")
            )
        if done.code != 0:
            logger.info("response %s: %s %s", self.id, done.code_name, done.message)
            return self._failed(ApiError.from_done(done, self.plan.fields))
        if self.answer.finish_reason == "length":
            return "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        return "completed", None

    def _failed(self, failure: ApiError) -> tuple[str, dict[str, Any]]:
        self._emit(wire.error(failure))
        return "failed", {"type": "failed", "error": failure.body["error"]}

    def _finish(self, status: str, details: dict[str, Any] | None) -> None:
        output = []
        item = self.item
        if item is not None:
            item.parts[0].finish("".join(self._text))
            text = item.parts[0].text  # what the client heard, if it truncated
            item.status = "completed" if status == "completed" else "incomplete"
            where = {"response_id": self.id, "item_id": item.id, "output_index": 0}
            if self._speaks:
                self._emit({"type": "response.output_audio.done", **where, "content_index": 0})
                self._emit(
                    {
                        "type": "response.output_audio_transcript.done",
                        **where,
                        "content_index": 0,
                        "transcript": text,
                    }
                )
            else:
                self._emit(
                    {"type": "response.output_text.done", **where, "content_index": 0, "text": text}
                )
            self._emit(
                {
                    "type": "response.content_part.done",
                    **where,
                    "content_index": 0,
                    "part": self._part_view(text),
                }
            )
            view = item.view()
            self._emit(
                {
                    "type": "response.output_item.done",
                    "response_id": self.id,
                    "output_index": 0,
                    "item": view,
                }
            )
            index = self._conversation.items.index(item) if item in self._conversation.items else 0
            previous = self._conversation.items[index - 1].id if index else None
            self._emit(
                {"type": "conversation.item.done", "previous_item_id": previous, "item": view}
            )
            output = [view]
        usage = None
        completed = self.answer.completed
        if completed is not None:
            used = completed.usage
            self._conversation.measured(self.plan.sent, used.prompt_tokens)
            if item is not None:
                item.tokens = used.completion_tokens
            audio_in = any(p.pcm for i in self.plan.sent for p in i.parts)
            usage = wire.usage(
                used.prompt_tokens, used.completion_tokens, audio_in=audio_in, speaks=self._speaks
            )
        view = self._view(status, details, output, usage)
        self._emit({"type": "response.done", "response": view})

    def _view(
        self,
        status: str,
        details: dict[str, Any] | None = None,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        plan = self.plan
        return wire.response(
            self.id,
            status,
            details=details,
            output=output,
            usage=usage,
            modalities=plan.modalities,
            voice=plan.voice,
            max_output_tokens=plan.max_output_tokens,
            metadata=plan.metadata,
        )


def response_id() -> str:
    return new_id("resp")
