"""How a request ended: the one vocabulary of ``Completed.finish_reason``.

Every engine says it in these words (an engine with reasons of its own, such as
vLLM, maps them here once), the stage sends them as they are, and clients read
them as docs/api.md ("Finish reasons") lists them; the gateway turns them into
OpenAI's. A plug-in that says anything else is refused when it says it
(``services.engines.base.FinishOutput``), not passed on to clients.
"""

from __future__ import annotations

from typing import Literal, get_args

FinishReason = Literal["eos", "stop", "length", "done", "abort"]
# eos: the model ended its answer (its end-of-sequence token: a text model's, the
#   talker's codec end).
# stop: one of the request's stop strings appeared (the text ends before it).
# length: it reached max_tokens (or the engine's own cap on new tokens).
# done: an engine that makes a whole output (an image, speech, a transcript,
#   audio from codes, video frames) made all of it.
# abort: the engine gave the request up before its end without being asked (vLLM
#   aborted it); what came so far is all there is.
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)


def finish_reason(reason: str) -> FinishReason:
    """``reason`` if it is one of ours; ValueError naming the others if not."""
    for known in FINISH_REASONS:
        if reason == known:
            return known
    raise ValueError(f"finish reason {reason!r} is none of {', '.join(FINISH_REASONS)}")
