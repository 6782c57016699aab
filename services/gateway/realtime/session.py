"""One realtime session: its settings, its conversation, its input audio buffer
(and server VAD over it) and the one response it may have in flight. It takes
client events in order and queues server events; a refused event changes
nothing and is answered with an ``error`` naming its field."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from orchestrator.client import AsyncClient
from services.gateway.catalog import Pipeline
from services.gateway.config import RealtimeLimits
from services.gateway.errors import ApiError
from services.gateway.realtime import client_events as ce
from services.gateway.realtime import wire
from services.gateway.realtime.conversation import Budget, Conversation, Item, Part, new_id
from services.gateway.realtime.items import part_of
from services.gateway.realtime.plan import plan_response, refill
from services.gateway.realtime.response import Emit, Events, Plan, Response
from services.gateway.realtime.session_config import (
    RATE,
    Audio,
    AudioInput,
    ServerVadSettings,
    SessionConfig,
)
from services.gateway.realtime.transcripts import AfterTranscripts, Transcripts
from services.gateway.realtime.vad import ServerVad, Turn
from services.gateway.schema import validate
from services.gateway.voices import Voices

logger = logging.getLogger(__name__)

BYTES_PER_MS = RATE * 2 // 1000
MIN_COMMIT_MS = 100  # as OpenAI's: a shorter buffer is refused


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
            output_modalities=modalities,  # type: ignore[arg-type]
            audio=Audio(input=AudioInput(turn_detection=detection)),
        )
        self.conversation = Conversation()
        self._buffer = bytearray()
        self._before_buffer = 0  # bytes of the session's audio before the buffer's first
        self._vad = ServerVad(detection) if detection is not None else None
        recogniser = pipeline.recogniser
        self._transcripts = (
            Transcripts(context.client, recogniser, token, emit) if recogniser else None
        )
        self._turn_item = ""  # the item id of the turn server VAD is hearing
        self._turn_start_ms = 0  # where it started, in the session's audio
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
                self._commit(len(self._buffer))
            case ce.AudioClear():
                self._drop_buffer(len(self._buffer))
                self._emit({"type": "input_audio_buffer.cleared"})
            case ce.ItemCreate():
                self._create_item(event)
            case ce.ItemRetrieve():
                item = self._item(event.item_id)
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
            # Its times count the session's audio from the start, as OpenAI's do.
            heard = (self._before_buffer + len(self._buffer)) // BYTES_PER_MS
            self._vad = ServerVad(detection, heard) if detection is not None else None
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
        if len(self._buffer) + len(pcm) > limit:
            raise ce.bad(
                "audio",
                f"the input audio buffer holds at most {limit} bytes "
                f"({len(self._buffer)} now): commit or clear it",
                "audio_buffer_full",
            )
        self._buffer += pcm
        if self._vad is not None:
            # Scored off the event loop: a long append is many frames.
            for turn in await asyncio.to_thread(self._vad.feed, pcm):
                self._on_turn(turn)

    def _on_turn(self, turn: Turn) -> None:
        assert self._vad is not None
        settings = self._vad.settings
        if turn.kind == "started":
            self._turn_item = new_id("item")
            self._turn_start_ms = turn.ms
            self._emit(
                {
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": turn.ms,
                    "item_id": self._turn_item,
                }
            )
            if settings.interrupt_response and self.response is not None:
                self.response.cancel("turn_detected")
            return
        self._emit(
            {
                "type": "input_audio_buffer.speech_stopped",
                "audio_end_ms": turn.ms,
                "item_id": self._turn_item,
            }
        )
        # Everything before the turn's padding is silence: left out of the item
        # (from where the turn started: ``turn.ms`` is where it stopped).
        start = (self._turn_start_ms - settings.prefix_padding_ms) * BYTES_PER_MS
        skip = max(0, start - self._before_buffer)
        try:
            self._commit(len(self._buffer), skip=skip, item_id=self._turn_item)
        except ApiError as exc:
            self._emit(wire.error(exc))
            return
        if settings.create_response and not self.busy:
            try:
                self._respond(ce.ResponseParams())
            except ApiError as exc:
                self._emit(wire.error(exc))

    def _commit(self, end: int, *, skip: int = 0, item_id: str = "") -> None:
        pcm = bytes(self._buffer[skip:end])
        entry = self._pipeline.entry
        if not self._pipeline.hears:
            self._drop_buffer(end)
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
        self._drop_buffer(end)
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

    def _drop_buffer(self, end: int) -> None:
        del self._buffer[:end]
        self._before_buffer += end

    # -- conversation items

    def _create_item(self, event: ce.ItemCreate) -> None:
        message = validate(ce.MessageItem, event.item, prefix="item")
        if message.id is not None and any(i.id == message.id for i in self.conversation.items):
            raise ce.bad("item.id", f"{message.id!r} is already in the conversation")
        limit = self._context.limits.max_audio_buffer_bytes
        parts = [
            part_of(message.role, part, f"item.content[{j}]", self._pipeline, limit)
            for j, part in enumerate(message.content)
        ]
        item = Item(message.role, parts)
        item.id = message.id or item.id
        after = event.previous_item_id
        if after == "root":
            self.conversation.items.insert(0, item)
            previous = None
        else:
            try:
                previous = self.conversation.add(item, after)
            except KeyError:
                raise ce.bad("previous_item_id", f"no item {after!r} in the conversation") from None
        self._added(item, previous)

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

    def _item(self, item_id: str) -> Item:
        for item in self.conversation.items:
            if item.id == item_id:
                return item
        raise ce.bad("item_id", f"no item {item_id!r} in the conversation", "item_not_found")

    def _delete(self, item_id: str) -> None:
        item = self._item(item_id)
        if self.busy and self.response is not None and self.response.item is item:
            raise ce.bad("item_id", "the response in progress is writing it: cancel it first")
        self.conversation.remove(item_id)
        self._emit({"type": "conversation.item.deleted", "item_id": item_id})

    def _truncate(self, event: ce.ItemTruncate) -> None:
        """The client played only ``audio_end_ms`` of an answer: its transcript is
        cut to the words said by then, so the next turn's context holds what
        the user heard (conversation.py says how)."""
        item = self._item(event.item_id)
        if item.role != "assistant":
            raise ce.bad("item_id", "only an assistant item's audio can be truncated")
        if event.content_index >= len(item.parts):
            raise ce.bad("content_index", f"the item has {len(item.parts)} part(s)")
        part = item.parts[event.content_index]
        if part.type != "output_audio":
            raise ce.bad("content_index", f"part {event.content_index} has no audio")
        # Past the audio sent (a player's clock runs on a little) cuts nothing.
        part.truncate(event.audio_end_ms)
        item.tokens = None  # estimated again from what is left
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
