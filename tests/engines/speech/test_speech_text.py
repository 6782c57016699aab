"""Incremental text for speech, without a stage: sentences cut where hibari
cuts them whatever the windows, characters never split."""

from __future__ import annotations

from hibari import Hibari

from services.engines.speech.text import Sentences, TokenText

TEXT = "Dr. Smith went home. He was 3.5 m tall!\nThen it rained. The end"


def test_sentences_are_cut_as_hibari_cuts_the_whole_text() -> None:
    for step in (1, 2, 7, len(TEXT)):
        sentences = Sentences(max_chars=300)
        said = []
        for i in range(0, len(TEXT), step):
            said += sentences.add(TEXT[i : i + step])
        said += sentences.rest()
        assert said == Hibari.split_sentences(TEXT), step


def test_a_sentence_waits_for_what_follows_its_end() -> None:
    sentences = Sentences(max_chars=300)
    assert sentences.add("It is late.") == []  # "late." might be "late.5": wait
    assert sentences.add(" Go") == ["It is late."]
    assert sentences.add(" home\n") == ["Go home"]


def test_text_without_an_end_is_spoken_in_pieces_at_spaces() -> None:
    sentences = Sentences(max_chars=20)
    said = sentences.add("one two three four five six seven eight nine")
    assert said and all(len(s) <= 20 for s in said)
    assert " ".join([*said, *sentences.rest()]) == "one two three four five six seven eight nine"


class Bytes:
    """A byte-level decoder: each id is one byte."""

    def decode(self, token_ids) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def test_a_character_split_over_ids_waits_for_its_last_byte() -> None:
    text = TokenText(Bytes())
    data = "Å日".encode()
    assert text.add(data[:1]) == ""
    assert text.add(data[1:2]) == "Å"
    assert text.add(data[2:4]) == ""
    assert text.add(data[4:]) == "日"
    assert text.add(data[:1]) == "" and text.rest() == "\ufffd"  # cut off: said as it is
