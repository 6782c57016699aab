"""The thinker streams its answer's text as the tokens come, decoding a few tokens at
each (services/engines/detokenizer.py), never its whole answer again: the text
joined is the whole answer decoded, and no decode reads more than a short window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.engines.base import TokenOutput
from services.testing.engine_runs import collect, generate, tokens_of
from tests.engines.qwen_omni import parts
from tests.engines.qwen_omni.reference import request

TOKENS = 40  # the old whole-answer decode read up to this many ids at a token


async def test_the_text_is_the_answers_read_a_few_tokens_at_a_time(
    tiny_omni: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    thinker = parts.thinker(tiny_omni)
    tokenizer = thinker._processor.tokenizer
    decode = tokenizer.decode
    widths: list[int] = []

    def counted(ids: Any, *args: Any, **kwargs: Any) -> Any:
        widths.append(len(ids))
        return decode(ids, *args, **kwargs)

    try:
        monkeypatch.setattr(tokenizer, "decode", counted)
        events = await collect(generate(thinker, request("text", max_tokens=TOKENS)))
        monkeypatch.undo()
        ids = tokens_of(events)
        text = "".join(e.text for e in events if isinstance(e, TokenOutput))
        assert len(ids) == TOKENS
        assert text == decode(ids, skip_special_tokens=True)
        # Five tokens of context, the token and any held back for an incomplete character.
        assert len(widths) >= TOKENS and max(widths) <= 12, widths
    finally:
        thinker.close()
