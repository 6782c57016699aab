"""One realtime session: its settings, its conversation, its input audio buffer
(and server VAD over it: input_audio.py) and the one response it may have in
flight. It takes client events in order and queues server events; a refused
event changes nothing and is answered with an ``error`` naming its field
(item_edits.py checks the client's edits of the conversation)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from orchestrator.client import AsyncClient
from services.gateway.catalog import Pipeline
from services.gateway.config import RealtimeLimits
from services.gateway.errors import ApiError
from services.gateway.realtime import client_events as ce
from services.gateway.realtime import item_edits, wire
from services.gateway.realtime.conversation import Budget, Conversation, Item, Part, new_id
from services.gateway.realtime.input_audio import InputAudioBuffer
from services.gateway.realtime.plan import plan_response, refill
from services.gateway.realtime.response import Emit, Events, Plan, Response
from services.gateway.realtime.session_config import (
    Audio,
    AudioInput,
    ServerVadSettings,
    SessionConfig,
)
from services.gateway.realtime.transcripts import AfterTranscripts, Transcripts
from services.gateway.realtime.vad import Turn
from services.gateway.voices import Voices

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Context:
    """What every session of a gateway shares."""

    client: AsyncClient
    limits: RealtimeLimits
    voices: Voices


class Session:
    def __init__(
        self,
        context: Context,
        pipeline: Pipeline,
        token: str | None,
        emit: Emit,
        *,
        model: str | None = None,
    ) -> None:
        """``model``: the name the client dialled (the pipeline's, or an OpenAI
        realtime name it serves), said back as the session's."""
        self.id = new_id("sess")
        self._context = context
        self._pipeline = pipeline
        self._token = token
        self._emit = emit
        modalities = ["audio"] if pipeline.audio_stage else ["text"]
        # A pipeline that hears starts with server VAD on, as OpenAI's sessions do.
        detection = ServerVadSettings() if pipeline.hears else None
        self.config = SessionConfig(
            model=model or pipeline.name,
            output_modalities=modalities,
            audio=Audio(input=AudioInput(turn_detection=detection)),
        )
        self.conversation = Conversation()
        self._audio = InputAudioBuffer(detection)
        recogniser = pipeline.recogniser
        self._transcripts = (
            Transcripts(context.client, recogniser, token, emit) if recogniser else None
        )
        self.response: Response | None = None

    @property
    def busy(self) -> bool:
        return self.response is not None and self.response.active

    def view(self) -> dict[str, Any]:
        limits = self._context.limits
        return {
            "object": "realtime.session",
            "id": self.id,
            **self.config.model_dump(mode="json"),
            "expires_at": 0,
            # The conversation each response sends (docs/api.md): oldest items first out.
            "conversation_budget": {
                "max_items": limits.max_items,
                "max_tokens": self._budget_tokens(),
                "dropped_items": self.conversation.dropped,
            },
        }

    async def handle(self, event: ce.Event) -> None:
        match event:
            case ce.SessionUpdate():
                self._update(event)
            case ce.AudioAppend():
                await self._append(event)
            case ce.AudioCommit():
                self._commit()
            case ce.AudioClear():
                self._audio.clear()
                self._emit({"type": "input_audio_buffer.cleared"})
            case ce.ItemCreate():
                limit = self._context.limits.max_audio_buffer_bytes
                self._added(*item_edits.create(self.conversation, event, self._pipeline, limit))
            case ce.ItemRetrieve():
                item = item_edits.find(self.conversation, event.item_id)
                self._emit({"type": "conversation.item.retrieved", "item": item.view()})
            case ce.ItemDelete():
                self._delete(event.item_id)
            case ce.ItemTruncate():
                self._truncate(event)
            case ce.ResponseCreate():
                self._respond(event.response)
            case ce.ResponseCancel():
                self._cancel(event.response_id)

    def close(self) -> None:
        if self.response is not None:
            self.response.cancel("client_cancelled")
        if self._transcripts is not None:
            self._transcripts.close()

    # -- settings

    def _update(self, event: ce.SessionUpdate) -> None:
        """Every field the mesh can serve applies; one ``error`` after
        ``session.updated`` names each field left as it was."""
        config, refused = self.config.updated(event.session)
        if not self._pipeline.serves(config.model, realtime=True):
            refused.append(ce.bad("session.model", f"this mesh serves {self._pipeline.name!r}"))
            config = config.model_copy(update={"model": self.config.model})
        if config.speaks and self._pipeline.audio_stage is None:
            refused.append(
                ce.bad(
                    "session.output_modalities",
                    f"model {self._pipeline.name!r} has no stage that speaks; use ['text']",
                )
            )
            config = config.model_copy(update={"output_modalities": self.config.output_modalities})
        changed = config != self.config
        detection = config.audio.input.turn_detection
        if detection != self.config.audio.input.turn_detection:
            self._audio.detect(detection)
        self.config = config
        if changed or not refused:
            self._emit({"type": "session.updated", "session": self.view()})
        if refused:
            raise _refusals(refused, changed)

    def _budget_tokens(self) -> int:
        truncation = self.config.truncation
        limit = self._context.limits.max_history_tokens
        if not isinstance(truncation, str) and truncation.token_limits is not None:
            return min(limit, truncation.token_limits.post_instructions)
        return limit

    # -- input audio

    async def _append(self, event: ce.AudioAppend) -> None:
        limit = self._context.limits.max_audio_buffer_bytes
        pcm = ce.pcm(event.audio, "audio", limit)
        for turn in await self._audio.append(pcm, limit):
            self._on_turn(turn)

    def _on_turn(self, turn: Turn) -> None:
        assert self._audio.vad is not None
        settings = self._audio.vad.settings
        if turn.kind == "started":
            item_id = self._audio.start_turn(turn.ms)
            self._emit(
                {
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": turn.ms,
                    "item_id": item_id,
                }
            )
            if settings.interrupt_response and self.response is not None:
                self.response.cancel("turn_detected")
            return
        item_id = self._audio.turn_item
        skip = self._audio.turn_skip(settings.prefix_padding_ms)
        if turn.kind in ("paused", "resumed"):
            # A pause may be the turn's end: hear the turn so far while the silence
            # window runs, so its transcript is (nearly) in when the turn commits.
            if self._transcripts is not None and self._pipeline.hears:
                self._transcripts.forget(item_id)
                if turn.kind == "paused":
                    self._transcripts.guess(item_id, self._audio.heard(skip))
            return
        self._emit(
            {
                "type": "input_audio_buffer.speech_stopped",
                "audio_end_ms": turn.ms,
                "item_id": item_id,
            }
        )
        try:
            self._commit(skip=skip, item_id=item_id)
        except ApiError as exc:
            self._emit(wire.error(exc))
            return
        if settings.create_response and not self.busy:
            try:
                self._respond(ce.ResponseParams())
            except ApiError as exc:
                self._emit(wire.error(exc))

    def _commit(self, *, skip: int = 0, item_id: str = "") -> None:
        pcm = self._audio.commit(self._pipeline, skip=skip)
        item = Item("user", [Part("input_audio", pcm=pcm)])
        item.id = item_id or item.id
        previous = self.conversation.add(item)
        self._emit(
            {
                "type": "input_audio_buffer.committed",
                "previous_item_id": previous,
                "item_id": item.id,
            }
        )
        self._added(item, previous)

    # -- conversation items

    def _added(self, item: Item, previous: str | None) -> None:
        if self._transcripts is not None:
            self._transcripts.start(item, self.config.audio.input.transcription)
        view = item.view()
        self._emit({"type": "conversation.item.added", "previous_item_id": previous, "item": view})
        self._emit({"type": "conversation.item.done", "previous_item_id": previous, "item": view})
        self.trimmed()

    def trimmed(self) -> list[Item]:
        """The conversation within its budget (kept so as items come, so a session
        holds no more than a response would send); items dropped are said."""
        truncation = self.config.truncation
        limits = self._context.limits
        if truncation == "disabled":  # no token budget; the item budget still holds
            budget = Budget(limits.max_items, 1 << 62)
        else:
            retention = truncation.retention_ratio if not isinstance(truncation, str) else 0.8
            budget = Budget(limits.max_items, self._budget_tokens(), retention)
        before = list(self.conversation.items)
        kept = self.conversation.within(budget)
        for item in before[: len(before) - len(kept)]:  # the oldest went
            self._emit({"type": "conversation.item.deleted", "item_id": item.id})
        return kept

    def _delete(self, item_id: str) -> None:
        item = item_edits.find(self.conversation, item_id)
        if self.busy and self.response is not None and self.response.item is item:
            raise ce.bad("item_id", "the response in progress is writing it: cancel it first")
        self.conversation.remove(item_id)
        self._emit({"type": "conversation.item.deleted", "item_id": item_id})

    def _truncate(self, event: ce.ItemTruncate) -> None:
        item = item_edits.truncate(self.conversation, event)
        self._emit(
            {
                "type": "conversation.item.truncated",
                "item_id": item.id,
                "content_index": event.content_index,
                "audio_end_ms": event.audio_end_ms,
            }
        )

    # -- responses

    def _respond(self, params: ce.ResponseParams) -> None:
        if self.busy:
            assert self.response is not None
            raise ce.bad(
                "type",
                f"response {self.response.id} is in progress: cancel it or wait "
                "for its response.done",
                "conversation_already_has_active_response",
            )
        plan = plan_response(self, params)
        self.response = Response(plan, self.conversation, self._emit)
        waits = self._transcripts.pending(plan.sent) if self._transcripts is not None else []
        if waits:
            self.response.start(AfterTranscripts(waits, lambda: self._send(plan, refilled=True)))
        else:
            self.response.start(self._send(plan))

    def _send(self, plan: Plan, *, refilled: bool = False) -> Events:
        if refilled:
            refill(plan, "audio" in self._pipeline.entry.accepts)
        return self._context.client.send(plan.request, token=self._token)

    def _cancel(self, response_id: str | None) -> None:
        response = self.response
        if response is None or not response.active:
            param = "response_id" if response_id else "type"
            raise ce.bad(param, "no response is in progress", "response_cancel_not_active")
        if response_id is not None and response_id != response.id:
            raise ce.bad("response_id", f"{response_id!r} is not in progress ({response.id} is)")
        response.cancel("client_cancelled")

    @property
    def pipeline(self) -> Pipeline:
        return self._pipeline

    @property
    def context(self) -> Context:
        return self._context


def _refusals(refused: list[ApiError], applied: bool) -> ApiError:
    """One ``error`` for a ``session.update``: ``param`` the first field refused,
    the message each of them, and whether the rest applied."""
    first = refused[0]
    rest = "the other fields were applied" if applied else "nothing was changed"
    listed = "; ".join(error.message for error in refused)
    code = first.code or "invalid_value"
    return ApiError(400, f"{listed} ({rest})", param=first.param, code=code)
