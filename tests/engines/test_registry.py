"""The engine table: every built-in name resolves to its class (imported only then),
and an unknown name is refused naming the known ones."""

from __future__ import annotations

import pytest

from services.engines.engine_args import EngineArgs
from services.engines.registry import ENGINES, engine_class, settings_model


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_built_in_engine_resolves_to_its_class(name: str) -> None:
    module, _, class_name = ENGINES[name].partition(":")
    found = engine_class(name)
    assert found.__module__.startswith(module) and found.__name__ == class_name
    model = settings_model(name)
    assert model is None or issubclass(model, EngineArgs)


def test_an_unknown_engine_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown engine 'nope' \(known: diffusers, "):
        engine_class("nope")
