"""The session's plain parts, without a network: the conversation's budget, the
settings' merge, and server VAD on real speech (hibari's) however it is chunked."""

from __future__ import annotations

import numpy as np
import pytest
from hibari import Hibari

from services.gateway.errors import ApiError
from services.gateway.realtime.conversation import Budget, Conversation, Item, Part
from services.gateway.realtime.session_config import (
    EAGERNESS_SILENCE_MS,
    SemanticVadSettings,
    SessionConfig,
)
from services.gateway.realtime.session_config import ServerVadSettings as TurnDetection
from services.gateway.realtime.vad import PAUSE_MS, ServerVad, Turn
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


def test_a_session_update_merges_and_a_refused_field_is_named_and_left_alone() -> None:
    config = SessionConfig(instructions="Be brief.")
    voiced, refused = config.updated({"audio": {"output": {"voice": "marin"}}})
    assert voiced.audio.output.voice == "marin" and voiced.instructions == "Be brief."
    assert voiced.audio.output.format.rate == 24000 and refused == []
    vad, _ = voiced.updated({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
    assert vad.audio.input.turn_detection == TurnDetection(type="server_vad")
    off, _ = vad.updated({"audio": {"input": {"turn_detection": None}}})
    assert off.audio.input.turn_detection is None
    # An unrelated field the mesh cannot serve does not cost the instructions.
    change = {
        "instructions": "x",
        "temperature": 0.5,
        "audio": {"output": {"format": {"rate": 16000}, "speed": 1.5}},
    }
    updated, refused = voiced.updated(change)
    assert [e.param for e in refused] == ["session.audio.output.format.rate", "session.temperature"]
    assert updated.instructions == "x" and updated.audio.output.speed == 1.5
    assert updated.audio.output.format.rate == 24000
    assert voiced.instructions == "Be brief."  # unchanged: configs are replaced, never mutated
    # Not an object at all: refused whole.
    with pytest.raises(ApiError) as whole:
        voiced.updated(["instructions"])
    assert whole.value.param == "session"


def test_what_the_frameworks_send_at_their_defaults_is_accepted() -> None:
    """The first session.update of openai-agents, Pipecat and LiveKit (their
    defaults, as probed): semantic VAD, input transcription, noise reduction,
    tracing, a realtime model name; and the beta shape's top-level names."""
    config, refused = SessionConfig().updated(
        {
            "type": "realtime",
            "model": "gpt-realtime-2.1",
            "instructions": "Speak like a pirate.",
            "audio": {
                "input": {
                    "turn_detection": {"type": "semantic_vad", "eagerness": "high"},
                    "transcription": {"model": "gpt-4o-mini-transcribe"},
                    "noise_reduction": {"type": "near_field"},
                }
            },
            "tracing": "auto",
        }
    )
    assert refused == []
    detection = config.audio.input.turn_detection
    assert isinstance(detection, SemanticVadSettings)
    assert detection.silence_duration_ms == EAGERNESS_SILENCE_MS["high"]
    assert config.audio.input.transcription is not None and config.tracing == "auto"
    # The client echoing a silence duration cannot set one eagerness does not say.
    echoed, _ = config.updated(
        {"audio": {"input": {"turn_detection": {"eagerness": "low", "silence_duration_ms": 1}}}}
    )
    assert echoed.audio.input.turn_detection.silence_duration_ms == EAGERNESS_SILENCE_MS["low"]  # type: ignore[union-attr]
    # Back to server VAD: a new type replaces the object, it is not merged into it.
    server, refused = config.updated(
        {"turn_detection": {"type": "server_vad"}, "input_audio_transcription": None}
    )
    assert refused == [] and server.audio.input.turn_detection == TurnDetection()
    assert server.audio.input.transcription is None
    _, refused = config.updated({"audio": {"input": {"turn_detection": {"eagerness": "now"}}}})
    assert [e.param for e in refused] == ["session.audio.input.turn_detection.eagerness"]


def test_a_truncated_answer_keeps_the_words_heard() -> None:
    second = 2 * RATE
    part = Part("output_audio", audio_bytes=4 * second)
    part.finish("one two  three four five six seven eight")
    part.truncate(2000)  # half the audio: half the words
    assert part.text == "one two  three four"
    part.truncate(3000)  # what was cut stays cut
    assert part.text == "one two  three four"
    part.truncate(1000)
    assert part.text == "one two"
    early = Part("output_audio", audio_bytes=2 * second)
    early.truncate(500)  # before the answer's text is whole: applied when it is
    early.finish("a b c d e f g h")
    assert early.text == "a b"
    past = Part("output_audio", audio_bytes=second)
    past.truncate(5000)
    past.finish("all of it")
    assert past.text == "all of it"
    told = Part("output_audio", text="a client's own transcript")  # no audio sent: kept
    told.truncate(0)
    assert told.text == "a client's own transcript"


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
    assert [t.kind for t in turns] == ["started", "paused", "stopped"]
    speech_end_ms = (len(spoken) - 3 * RATE) * 1000 // (RATE * 2)
    assert 400 <= turns[0].ms <= 900
    assert speech_end_ms <= turns[1].ms <= speech_end_ms + 900
    reference = ServerVad(TurnDetection(type="server_vad", silence_duration_ms=500))
    assert turns == reference.feed(spoken)  # the same frames, the same turns


def test_sessions_share_the_model_and_keep_their_own_state(spoken: bytes) -> None:
    """Every session's VAD runs on one onnxruntime session, each with its own
    recurrent state: two sessions fed in turns, one speaking and one in quiet
    noise, hear what each hears alone."""
    rng = np.random.default_rng(0)
    hiss = wav.pcm16(rng.standard_normal(len(spoken) // 2).astype(np.float32) * 0.003)
    alone = [ServerVad(TurnDetection(type="server_vad")).feed(clip) for clip in (spoken, hiss)]
    assert [t.kind for t in alone[0]] == ["started", "paused", "stopped"] and alone[1] == []
    together = [ServerVad(TurnDetection(type="server_vad")) for _ in range(2)]
    heard: list[list[Turn]] = [[], []]
    step = RATE * 2 * 20 // 1000
    for i in range(0, len(spoken), step):
        for k, clip in enumerate((spoken, hiss)):
            heard[k] += together[k].feed(clip[i : i + step])
    assert heard == alone


def _trimmed(clip: np.ndarray) -> np.ndarray:
    """The clip without its quiet head and tail (hibari pads both)."""
    loud = np.flatnonzero(np.abs(clip) > 0.02)
    return clip[loud[0] : loud[-1] + 1]


def test_a_pause_inside_a_turn_is_said_and_taken_back_when_speech_resumes() -> None:
    """The session's cue to hear a turn early: ``paused`` after PAUSE_MS of quiet,
    ``resumed`` when speech comes back inside the silence window (one turn), and
    no pause at all when the window is shorter than PAUSE_MS."""
    voice = Hibari()
    quiet = np.zeros(RATE * 350 // 1000, np.float32)  # longer than PAUSE_MS, under 500
    halves = [_trimmed(voice("What is the capital", seed=0)), _trimmed(voice("of France?"))]
    stream = wav.pcm16(np.concatenate([halves[0], quiet, halves[1], np.zeros(RATE)]))
    vad = ServerVad(TurnDetection(type="server_vad", silence_duration_ms=500))
    turns = vad.feed(stream)
    assert [t.kind for t in turns] == ["started", "paused", "resumed", "paused", "stopped"]
    assert turns[1].ms >= len(wav.pcm16(halves[0])) * 1000 // (RATE * 2) + PAUSE_MS - 32
    assert turns[4].ms - turns[3].ms == -(-500 // 32) * 32 - PAUSE_MS  # the quiet, counted on
    short = ServerVad(TurnDetection(type="server_vad", silence_duration_ms=PAUSE_MS - 32))
    assert "paused" not in [t.kind for t in short.feed(stream)]


def test_server_vad_hears_nothing_in_silence_and_counts_from_its_start() -> None:
    vad = ServerVad(TurnDetection(type="server_vad"), start_ms=5000)
    assert vad.feed(bytes(RATE * 2 * 2)) == []
    assert vad.ms == 5000 + 2000 - 2000 % 32
