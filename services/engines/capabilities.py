"""What an engine may do beyond the contract in base.py, each a protocol the stage
checks for (``isinstance``) and uses where an engine has it: writing outputs into
shared blocks, planning or sizing its KV cache, hearing of arrivals, taking a
window as soon as it is checked, keeping per-request state, holding input back,
preparing its model once, fetching files besides it; and the voices and content
kinds it offers. ``planned`` is what a stage does with a request before it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from services.engines.base import Engine, EnginePlan, EngineRequest, OutputBlocks, PlanT


@runtime_checkable
class WritesIntoBlocks(Protocol):
    """An engine that can write a large output straight into a buffer it is
    given: the stage hands it its shared-memory blocks once, before ``load``."""

    def use_output_blocks(self, blocks: OutputBlocks) -> None: ...


@runtime_checkable
class PlansKvCache(Protocol):
    """An engine whose KV cache the stage's memory plan bounds (MEMORY_PLANNED)."""

    def plan_kv_cache(self, pages: int, page_size: int) -> None:
        """At most ``pages`` KV pages of ``page_size`` tokens may be held at once.
        Called after ``load``, before ``warmup``."""
        ...


@runtime_checkable
class SizesKvCache(Protocol):
    """An engine that sizes its own KV cache (vLLM: it profiles the GPU, or takes
    the size it is given on a CPU). The stage reports that cache as its memory plan
    instead of computing one from free memory, and measures no free memory before
    ``load``: on a GPU that would open a CUDA context in the stage process, beside
    (and before) the engine's own."""

    def kv_cache(self) -> tuple[int, int]:
        """``(pages, page_size)``: the cache the engine allocated, after ``load``."""
        ...


@runtime_checkable
class HearsArrivals(Protocol):
    """An engine whose idle scheduler waits a moment for requests arriving together,
    so that they share their prefill: the stage tells it a request is on its way
    (``arriving``) before its ``check``, so that requests checked together all count
    while it gathers the first."""

    def arriving(self) -> None: ...


@runtime_checkable
class TakesWindowsEarly(Protocol):
    """An engine that uses a streaming request's input window as soon as it is
    checked, before that window's ``generate`` runs (the talker steps on the
    thinker's rows while the thinker writes on). The stage hands it each plan its
    ``check`` returned (``take``), in the order the windows came."""

    def take(self, plan: EnginePlan) -> None: ...


def planned(engine: Engine[PlanT], request: EngineRequest) -> PlanT:
    """What a stage does with a request (or a later window of one) before it runs
    it: an engine that hears of arrivals is told, ``check`` plans it (and only
    checks), an engine that takes windows early gets the plan. A stage calls it in
    a thread: ``check`` may tokenize."""
    if isinstance(engine, HearsArrivals):
        engine.arriving()
    plan = engine.check(request)
    if isinstance(engine, TakesWindowsEarly):
        engine.take(plan)
    return plan


@runtime_checkable
class KeepsRequestState(Protocol):
    """An engine that keeps state per request from one ``generate`` call to the
    next (the input windows of a streaming request: KV caches, a decoder's
    memory). The stage calls ``release`` once the request has ended, on every
    path (completed, failed, cancelled, its stream gone)."""

    def release(self, request_id: str) -> None: ...


@runtime_checkable
class HoldsInputBack(Protocol):
    """An engine that may hold the end of a request's input back until more of
    it comes (a sentence not finished yet, a character whose bytes are not all
    there). When the request's input has ended (its last window, or its only
    Submit, has run) the stage asks for the rest and runs that plan too."""

    def input_ended(self, request_id: str) -> EnginePlan | None:
        """The plan that finishes ``request_id`` (None: nothing was held back)."""
        ...


@runtime_checkable
class PreparesModel(Protocol):
    """An engine that first turns a fetched model into the form it loads, once per
    file (a GGUF converted to safetensors). The stage runs it as its own start-up
    step (PREPARE, saying what it does) before ``load``, which would do it anyway."""

    def preparation(self, model_path: Path) -> str | None:
        """What ``prepare`` will do to this file, or None when it is done already."""
        ...

    def prepare(self, model_path: Path) -> None: ...


@runtime_checkable
class FetchesFiles(Protocol):
    """An engine that needs files besides its model (a voice by URL). The stage
    fetches each source as it fetches the model (DOWNLOAD_* events, paused by the
    init watchdog) and hands the paths over before ``load``."""

    def sources(self) -> dict[str, str]:
        """What to fetch: a name the engine knows it by, and its source."""
        ...

    def use_files(self, paths: dict[str, Path]) -> None: ...


TEXT_ONLY: frozenset[str] = frozenset({"text"})


def offered_voices(engine: object) -> list[str]:
    """The voices a speech engine offers (its ``voices``, the first its default)."""
    return list(getattr(engine, "voices", ()))


def accepted_kinds(engine: object) -> frozenset[str]:
    """The content kinds ``engine`` takes: its ``accepts`` class attribute, or text only."""
    kinds = getattr(engine, "accepts", TEXT_ONLY)
    return frozenset(kinds)
