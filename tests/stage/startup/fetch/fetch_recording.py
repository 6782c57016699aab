"""A fetch hook that records every event, and ``fetch`` that runs a fetch through
it and checks the events came in the order a stage reports them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.stage.startup.fetch import FetchResult, fetch_model


class RecordingHook:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any, Any]] = []

    def start(self, source: str, bytes_total: int | None) -> None:
        self.events.append(("start", source, bytes_total))

    def progress(self, bytes_done: int, bytes_total: int | None) -> None:
        self.events.append(("progress", bytes_done, bytes_total))

    def done(self, result: FetchResult, duration_s: float) -> None:
        self.events.append(("done", result, duration_s))

    def preparing(self, what: str) -> None:
        self.events.append(("preparing", what, None))

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, *_ in self.events if kind != "progress"]

    @property
    def progress_events(self) -> list[tuple[int, int | None]]:
        return [(a, b) for kind, a, b in self.events if kind == "progress"]


def fetch(source: str, cache: Path, **kwargs: float) -> tuple[FetchResult, RecordingHook]:
    hook = RecordingHook()
    result = fetch_model(source, cache, hook, **kwargs)
    # An archive is unpacked after its bytes are in: local work, named as such.
    assert hook.kinds[:2] == ["start", "done"] and hook.kinds[2:] in ([], ["preparing"])
    assert next(e for e in hook.events if e[0] == "done")[1] == result
    return result, hook
