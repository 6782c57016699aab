"""Which default a request gets: one function, one precedence (request > stage
file `defaults:` > engine_args > built-in), each layer winning in turn."""

from __future__ import annotations

import pytest

from services.engines.base import SamplingParams
from services.engines.defaults import (
    TEXT_BUILT_IN,
    DefaultLayers,
    RequestDefaults,
    TextDefaults,
    resolve,
)
from services.engines.diffusers.config import BUILT_IN, DiffusersArgs

LAYERS = DefaultLayers(
    stage=RequestDefaults(temperature=0.2, stop=("stage",), seed=2),
    engine=TextDefaults(temperature=0.3),
    built_in=RequestDefaults(temperature=0.4, stop=("built-in",)),
)


@pytest.mark.parametrize(
    ("layers", "asked", "temperature"),
    [
        (LAYERS, 0.1, 0.1),  # the request's own value
        (LAYERS, None, 0.2),  # the stage file's `defaults:`
        (DefaultLayers(RequestDefaults(), LAYERS.engine, LAYERS.built_in), None, 0.3),
        (DefaultLayers(RequestDefaults(), TextDefaults(), LAYERS.built_in), None, 0.4),
        (DefaultLayers(), None, None),  # no layer: still unset
    ],
    ids=["request", "stage", "engine_args", "built_in", "none"],
)
def test_each_layer_wins_in_turn(
    layers: DefaultLayers, asked: float | None, temperature: float | None
) -> None:
    assert resolve(SamplingParams(temperature=asked), layers).temperature == temperature


def test_every_parameter_is_resolved_on_its_own() -> None:
    asked = SamplingParams(max_tokens=5, stop=("mine",), top_k=0)
    params = resolve(asked, DefaultLayers(LAYERS.stage, LAYERS.engine, TEXT_BUILT_IN))
    assert (params.max_tokens, params.stop, params.top_k) == (5, ("mine",), 0)  # 0 is a value
    assert (params.temperature, params.seed) == (0.2, 2)  # from the stage
    assert (params.top_p, params.num_inference_steps) == (1.0, None)  # built-in; nobody's
    assert resolve(params, LAYERS) == params  # resolving twice changes nothing


def test_diffusers_engine_args_are_its_engine_layer() -> None:
    args = DiffusersArgs(num_inference_steps=3)
    layers = DefaultLayers(RequestDefaults(guidance_scale=2.0), args.request_defaults, BUILT_IN)
    params = resolve(SamplingParams(), layers)
    assert (params.num_inference_steps, params.guidance_scale, params.preview_every) == (3, 2.0, 0)
