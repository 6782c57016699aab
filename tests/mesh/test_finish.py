"""One vocabulary of finish reasons: the one engines may say, the one docs/api.md
lists for clients and stage.proto names, and the gateway's OpenAI words for each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.engines.base import FinishOutput
from services.mesh.finish import FINISH_REASONS

REPO = Path(__file__).resolve().parents[2]


def _documented() -> list[str]:
    text = (REPO / "docs" / "api.md").read_text()
    section = text.split("## Finish reasons", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)[1:]  # the header


def test_the_docs_and_the_proto_list_exactly_the_reasons_engines_may_say() -> None:
    assert _documented() == list(FINISH_REASONS)
    proto = (REPO / "protos" / "omni" / "v1" / "stage.proto").read_text()
    comment = proto.split("string finish_reason = 2;", 1)[0].rsplit("\n", 2)[-2]
    assert re.findall(r'"(\w+)"', comment) == list(FINISH_REASONS)


@pytest.mark.parametrize("reason", ["stopped", "cancelled", "", "EOS"])
def test_an_engine_saying_another_reason_is_refused_where_it_says_it(reason: str) -> None:
    with pytest.raises(ValueError, match=f"finish reason {reason!r} is none of eos, stop"):
        FinishOutput(reason)  # type: ignore[arg-type]


def test_the_gateway_says_each_reason_in_openais_words() -> None:
    from services.gateway.chat import FINISH

    assert set(FINISH) == set(FINISH_REASONS)
    # OpenAI's own, and the abort vLLM's OpenAI server passes on as it is.
    assert set(FINISH.values()) <= {"stop", "length", "abort"}
    assert FINISH["length"] == "length" and FINISH["eos"] == FINISH["stop"] == "stop"
