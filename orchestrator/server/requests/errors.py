"""What can end a request inside the orchestrator, each with the status its Done
carries (``services.mesh.errors`` maps them; the Done names ``stage``).

``NotStarted``    the router would not start it (paused too long, a stage not
                  ready, an edge's transform not offered)
``StreamBroken``  the shared stage stream it was on broke (``replica_stream``)
``StageFailed``   a stage ended it with an error, or went away under it (``flow``;
                  ``first_failure`` picks it out of the request's TaskGroup)
"""

from __future__ import annotations

import grpc

from services.mesh.errors import OmniError, forget


class NotStarted(OmniError):
    """The request cannot start: ``error`` says why, naming ``stage`` ("" for none)."""

    def __init__(self, stage: str, error: OmniError) -> None:
        super().__init__(error.message, field=error.field)
        self.code = error.code
        self.stage = stage


class StreamBroken(OmniError):
    """The shared stream a request was on broke: the stage (or the path to it) is gone."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    def again(self) -> StreamBroken:
        """A fresh one to raise in one request: one instance raised in many would
        gather all their tracebacks, and hold every frame (and Submit) in them."""
        return StreamBroken(self.code, self.details)


class StageFailed(OmniError):
    """A stage ended the request with an error, or the stage itself went away."""

    def __init__(self, stage: str, code: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(message, field=field)
        self.code = code
        self.stage = stage


def first_failure(group: BaseExceptionGroup[BaseException]) -> StageFailed:
    """The first stage failure in a request's TaskGroup ``group``; anything else in
    it (a bug) is raised, its traceback kept for the log.

    The group is forgotten, tracebacks and all: a traceback holds every frame it
    passed through, and with them the request's Submits (a client's 60 MB tensor).
    Python 3.11's TaskGroup keeps its group in a reference cycle with its frame,
    which only the cyclic collector breaks, and that may not run for minutes."""
    failures, rest = group.split(StageFailed)
    if rest is not None:
        raise rest
    forget(group)
    assert failures is not None
    first = failures.exceptions[0]
    assert isinstance(first, StageFailed)
    return first
