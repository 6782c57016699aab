"""Input transcription in a realtime session whose pipeline hears through a
recogniser stage (transcribe.py says why at the edge): each user turn of audio
goes to the recogniser once, as it joins the conversation, and its transcript
becomes the item's (what later responses send the mesh instead of the audio).
With ``session.audio.input.transcription`` set, the session says so as OpenAI's
does: ``conversation.item.input_audio_transcription.delta`` as the recogniser
streams, then ``.completed`` (or ``.failed``, naming the part).

Server VAD closes a turn only after its silence window (500 ms by default), and
hearing a turn takes about as long again on a CPU. So at the turn's first pause
(vad.py's ``paused``) the turn so far is heard at once, a guess; if the turn
then commits with no more speech (the same audio and silence after it), the
guess is its transcript, and the recogniser's time hides inside the silence
window. Speech again drops the guess."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.client import AsyncClient
from services.gateway import transcribe
from services.gateway.errors import ApiError
from services.gateway.realtime import wire
from services.gateway.realtime.conversation import Item
from services.gateway.realtime.response import Emit, Events
from services.gateway.realtime.session_config import RATE, Transcription
from services.mesh import wav
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2

logger = logging.getLogger(__name__)

PREFIX = "conversation.item.input_audio_transcription"


class Transcripts:
    """The transcriptions of one session, each a task until its transcript is in."""

    def __init__(self, client: AsyncClient, stage: str, token: str | None, emit: Emit) -> None:
        self._client = client
        self._stage = stage
        self._token = token
        self._emit = emit
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._guess: Guess | None = None

    def guess(self, item_id: str, pcm: bytes) -> None:
        """Hear ``pcm``, the turn ``item_id`` so far, ahead of its commit."""
        self.forget(self._guess.item_id if self._guess is not None else "")
        heard = asyncio.create_task(self._hear(pcm, None, {}, None), name=f"guess {item_id}")
        heard.add_done_callback(_unread)  # a dropped guess's failure is nobody's
        self._guess = Guess(item_id, pcm, heard)

    def forget(self, item_id: str) -> None:
        """Drop the guess at turn ``item_id`` (it spoke again)."""
        if self._guess is not None and self._guess.item_id == item_id:
            self._guess.heard.cancel()
            self._guess = None

    def start(self, item: Item, settings: Transcription | None) -> None:
        """Transcribe ``item``'s audio parts (a user turn), one after another."""
        guess, self._guess = self._guess, None
        if guess is not None and not guess.fits(item):
            guess.heard.cancel()
            guess = None
        if item.role == "user" and any(p.pcm for p in item.parts):
            task = asyncio.create_task(
                self._run(item, settings, guess), name=f"transcribe {item.id}"
            )
            self._tasks[item.id] = task
            task.add_done_callback(lambda _: self._tasks.pop(item.id, None))

    def pending(self, items: list[Item]) -> list[asyncio.Task[None]]:
        """The transcriptions ``items`` still wait for."""
        return [task for item in items if (task := self._tasks.get(item.id)) is not None]

    def close(self) -> None:
        self.forget(self._guess.item_id if self._guess is not None else "")
        for task in list(self._tasks.values()):
            task.cancel()

    def _deltas(self, where: dict[str, Any]) -> Callable[[str], None]:
        def said(delta: str) -> None:
            self._emit({"type": f"{PREFIX}.delta", **where, "delta": delta})

        return said

    async def _hear(
        self,
        pcm: bytes,
        settings: Transcription | None,
        fields: dict[str, str],
        on_delta: Callable[[str], None] | None,
    ) -> transcribe.Transcript:
        audio = stage_pb2.Media(media_type=wav.MEDIA_TYPE)
        audio.data = wav.header(RATE, 1, len(pcm)) + pcm
        language = settings.language if settings is not None else None
        prompt = settings.prompt if settings is not None else None
        request = transcribe.request(self._stage, audio, language, prompt)
        into = transcribe.Transcript(on_delta=on_delta)
        return await transcribe.transcribe(self._client, self._token, request, fields, into)

    async def _run(self, item: Item, settings: Transcription | None, guess: Guess | None) -> None:
        for index, part in enumerate(item.parts):
            if not part.pcm:
                continue
            where = {"item_id": item.id, "content_index": index}
            fields = {"inputs.messages[0].parts[0]": f"item.content[{index}].audio"}
            on_delta = self._deltas(where) if settings else None
            said = None
            if guess is not None and index == 0:
                try:
                    said = await guess.heard
                except (ApiError, asyncio.CancelledError):
                    said = None  # heard again below, as if never guessed
                if said is not None and on_delta is not None and said.whole:
                    on_delta(said.whole)
            try:
                if said is None:
                    said = await self._hear(part.pcm, settings, fields, on_delta)
            except ApiError as exc:
                logger.info("item %s: transcription failed: %s", item.id, exc.message)
                if settings is not None:
                    failure = wire.error(exc)["error"]
                    self._emit({"type": f"{PREFIX}.failed", **where, "error": failure})
                else:
                    self._emit(wire.error(exc))
                continue
            part.text = said.whole
            item.tokens = None  # counted again from the text
            if settings is not None:
                usage = {"type": "duration", "seconds": said.seconds}
                self._emit(
                    {
                        "type": f"{PREFIX}.completed",
                        **where,
                        "transcript": part.text,
                        "usage": usage,
                    }
                )


def _unread(task: asyncio.Task[transcribe.Transcript]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True)
class Guess:
    """A turn heard at its first pause: ``pcm`` then, and the recogniser's answer."""

    item_id: str
    pcm: bytes
    heard: asyncio.Task[transcribe.Transcript]

    def fits(self, item: Item) -> bool:
        """Whether ``item`` is that turn with nothing but quiet after the pause (the
        VAD said no more speech): its first audio part starts with the same audio."""
        parts = [p for p in item.parts if p.pcm]
        return item.id == self.item_id and bool(parts) and parts[0].pcm.startswith(self.pcm)


class AfterTranscripts:
    """A response's events, its request sent once the transcripts of the turns
    it sends are in (a turn committed a moment ago is still being heard)."""

    def __init__(self, waits: list[asyncio.Task[None]], send: Callable[[], Events]) -> None:
        self._waits = waits
        self._send = send
        self._events: Events | None = None

    async def __aiter__(self) -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
        await asyncio.wait(self._waits)  # not gather: a cancelled response leaves them be
        self._events = self._send()
        async for event in self._events:
            yield event

    def cancel(self) -> None:
        if self._events is not None:
            self._events.cancel()
