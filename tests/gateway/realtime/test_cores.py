"""The session's plain parts, without a network: the conversation's budget, the
settings' merge, and server VAD on real speech (hibari's) however it is chunked."""

from __future__ import annotations

import numpy as np
import pytest
from hibari import Hibari

from services.gateway.errors import ApiError
from services.gateway.realtime.conversation import Budget, Conversation, Item, Part
from services.gateway.realtime.session_config import SessionConfig, TurnDetection
from services.gateway.realtime.vad import ServerVad
from services.mesh import wav

RATE = 24000


def _text(text: str) -> Item:
    return Item("user", [Part("input_text", text=text)])


def test_the_budget_drops_the_oldest_items_first() -> None:
    conversation = Conversation()
    items = [_text(f"message {i}") for i in range(6)]
    for item in items:
        conversation.add(item)
    kept = conversation.within(Budget(max_items=4, max_tokens=10_000))
    assert kept == items[2:] and conversation.dropped == 2
    # Over the token budget: cut to the retention share of it, oldest first.
    for item in kept:
        item.tokens = 10
    kept = conversation.within(Budget(max_items=4, max_tokens=35, retention=0.6))
    assert kept == items[4:]
    # The newest item stays even alone over the budget (the stage says if it is too long).
    assert conversation.within(Budget(max_items=4, max_tokens=1)) == items[5:]


def test_measured_tokens_go_to_the_items_sent_for_the_first_time() -> None:
    conversation = Conversation()
    old, new_a, new_b = _text("x" * 30), _text("y" * 30), _text("z" * 60)
    old.tokens = 12
    for item in (old, new_a, new_b):
        conversation.add(item)
    conversation.measured([old, new_a, new_b], input_tokens=72)
    assert old.tokens == 12  # measured before: kept
    assert new_a.tokens is not None and new_b.tokens is not None
    assert new_a.tokens + new_b.tokens == 60 and new_b.tokens > new_a.tokens


def test_a_session_update_merges_and_a_refused_one_changes_nothing() -> None:
    config = SessionConfig(instructions="Be brief.")
    voiced = config.updated({"audio": {"output": {"voice": "marin"}}})
    assert voiced.audio.output.voice == "marin" and voiced.instructions == "Be brief."
    assert voiced.audio.output.format.rate == 24000
    vad = voiced.updated({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
    assert vad.audio.input.turn_detection == TurnDetection(type="server_vad")
    assert (
        vad.updated({"audio": {"input": {"turn_detection": None}}}).audio.input.turn_detection
        is None
    )
    with pytest.raises(ApiError) as refused:
        voiced.updated({"instructions": "x", "audio": {"output": {"format": {"rate": 16000}}}})
    assert refused.value.param == "session.audio.output.format.rate"
    assert voiced.instructions == "Be brief."  # unchanged: configs are replaced, never mutated


@pytest.fixture(scope="module")
def spoken() -> bytes:
    """Half a second of silence, a sentence, a second of silence: 16-bit, 24 kHz."""
    speech = Hibari()("The boat sails out of the harbour at dawn.", seed=0)
    silence = np.zeros(RATE // 2, np.float32)
    return wav.pcm16(np.concatenate([silence, speech, silence, silence]))


@pytest.mark.parametrize("chunk_ms", [20, 100, 1000, 0], ids=["20ms", "100ms", "1s", "whole"])
def test_server_vad_hears_one_turn_however_the_audio_is_chunked(
    spoken: bytes, chunk_ms: int
) -> None:
    vad = ServerVad(TurnDetection(type="server_vad", silence_duration_ms=500))
    step = RATE * 2 * chunk_ms // 1000 or len(spoken)
    turns = [t for i in range(0, len(spoken), step) for t in vad.feed(spoken[i : i + step])]
    assert [t.kind for t in turns] == ["started", "stopped"]
    speech_end_ms = (len(spoken) - 3 * RATE) * 1000 // (RATE * 2)
    assert 400 <= turns[0].ms <= 900
    assert speech_end_ms <= turns[1].ms <= speech_end_ms + 900
    reference = ServerVad(TurnDetection(type="server_vad", silence_duration_ms=500))
    assert turns == reference.feed(spoken)  # the same frames, the same turns


def test_server_vad_hears_nothing_in_silence_and_counts_from_its_start() -> None:
    vad = ServerVad(TurnDetection(type="server_vad"), start_ms=5000)
    assert vad.feed(bytes(RATE * 2 * 2)) == []
    assert vad.ms == 5000 + 2000 - 2000 % 32
