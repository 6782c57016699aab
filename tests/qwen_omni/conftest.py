"""The tiny random Qwen3-Omni checkpoint, built once per test session, and the
monolithic model's answers on it (one per prompt kind), computed once."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engines.qwen_omni import tiny
from tests.qwen_omni.reference import Reference, monolithic


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save(tmp_path_factory.mktemp("qwen3-omni-tiny"))


_REFERENCES: dict[str, Reference] = {}


@pytest.fixture(scope="session")
def reference(tiny_omni: Path):  # type: ignore[no-untyped-def]
    def get(kind: str) -> Reference:
        if kind not in _REFERENCES:
            _REFERENCES[kind] = monolithic(tiny_omni, kind)
        return _REFERENCES[kind]

    return get
