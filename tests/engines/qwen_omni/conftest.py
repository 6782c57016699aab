"""The tiny random Qwen3-Omni checkpoint, built once per test session, and the
monolithic model's answers on it (one per prompt kind), computed once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engines.qwen_omni import tiny
from tests.engines.qwen_omni.concurrency import COUNTS, Engines, Spoken
from tests.engines.qwen_omni.reference import Reference, monolithic


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save(tmp_path_factory.mktemp("qwen3-omni-tiny"))


_REFERENCES: dict[str, Reference] = {}


@pytest.fixture(scope="session")
def reference(tiny_omni: Path):
    def get(kind: str) -> Reference:
        if kind not in _REFERENCES:
            _REFERENCES[kind] = monolithic(tiny_omni, kind)
        return _REFERENCES[kind]

    return get


@pytest.fixture(scope="session")
def engines(tiny_omni: Path) -> Iterator[Engines]:
    """The three engines in float32, as the stages run them, recording logit rows."""
    built = Engines(tiny_omni)
    yield built
    built.close()


@pytest.fixture(scope="session")
def alone(tiny_omni: Path, engines: Engines) -> tuple[list[Spoken], list[Spoken]]:
    """Each of the concurrency requests served alone, in float32 and in float64 (where
    the two part at a near-tie, the rule compares a batched run up to there only)."""
    exact = Engines(tiny_omni, dtype="float64")

    async def each(built: Engines, tag: str) -> list[Spoken]:
        return [await built.speak(i, f"{tag}{i}") for i in range(max(COUNTS))]

    try:
        return asyncio.run(each(engines, "alone")), asyncio.run(each(exact, "exact"))
    finally:
        exact.close()
