"""A client's edits of a session's conversation (``conversation.item.create``,
``.retrieve``, ``.truncate``): each checked against the conversation, refused
with the field named before anything changes, then applied. The session does
what follows (transcription, the budget, the deletes a response forbids) and
says what changed."""

from __future__ import annotations

from services.gateway.catalog import Pipeline
from services.gateway.realtime import client_events as ce
from services.gateway.realtime.conversation import Conversation, Item
from services.gateway.realtime.items import part_of
from services.gateway.schema import validate


def create(
    conversation: Conversation, event: ce.ItemCreate, pipeline: Pipeline, audio_limit: int
) -> tuple[Item, str | None]:
    """The client's item, part by part (items.py), placed after its
    ``previous_item_id`` ("root": first); the item and the id of the one before it."""
    message = validate(ce.MessageItem, event.item, prefix="item")
    if message.id is not None and any(i.id == message.id for i in conversation.items):
        raise ce.bad("item.id", f"{message.id!r} is already in the conversation")
    parts = [
        part_of(message.role, part, f"item.content[{j}]", pipeline, audio_limit)
        for j, part in enumerate(message.content)
    ]
    item = Item(message.role, parts)
    item.id = message.id or item.id
    after = event.previous_item_id
    if after == "root":
        conversation.items.insert(0, item)
        return item, None
    try:
        return item, conversation.add(item, after)
    except KeyError:
        raise ce.bad("previous_item_id", f"no item {after!r} in the conversation") from None


def find(conversation: Conversation, item_id: str) -> Item:
    for item in conversation.items:
        if item.id == item_id:
            return item
    raise ce.bad("item_id", f"no item {item_id!r} in the conversation", "item_not_found")


def truncate(conversation: Conversation, event: ce.ItemTruncate) -> Item:
    """The client played only ``audio_end_ms`` of an answer: its transcript is
    cut to the words said by then, so the next turn's context holds what
    the user heard (conversation.py says how)."""
    item = find(conversation, event.item_id)
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
    return item
