"""What a request gets for a parameter it leaves unset: one precedence, one function.

A request's own value wins; then the stage file's ``defaults:``; then the
engine's ``engine_args`` (``engine_args.defaults`` for the text engines, the
top-level ``num_inference_steps``, ``guidance_scale`` and ``preview_every`` for
diffusers); then the engine's built-in value. ``resolve`` is the only place this
happens: each engine calls it with the layers it was built with, and the stage
hands its ``defaults:`` down (``EngineSettings.defaults``) instead of filling
them in itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from services.mesh.config_files import Frozen

if TYPE_CHECKING:
    from services.engines.base import SamplingParams


class RequestDefaults(Frozen):
    """Values for GenerationParams a request leaves unset (None: no value here);
    the shape of a stage file's ``defaults:`` section."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: tuple[str, ...] = ()
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, allow_inf_nan=False)
    height: int | None = Field(None, ge=8)
    width: int | None = Field(None, ge=8)
    preview_every: int | None = Field(None, ge=0)


class TextDefaults(Frozen):
    """``engine_args.defaults`` of a text engine: the sampling parameters only."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)


NONE = RequestDefaults()
TEXT_BUILT_IN = RequestDefaults(max_tokens=128, temperature=1.0, top_p=1.0, top_k=0)


@dataclass(frozen=True)
class DefaultLayers:
    """Where a request's unset parameters come from, highest first."""

    stage: BaseModel = NONE  # the stage file's `defaults:`
    engine: BaseModel = NONE  # the engine's engine_args
    built_in: BaseModel = NONE  # the engine's own


def resolve(params: SamplingParams, layers: DefaultLayers) -> SamplingParams:
    """``params`` with every unset value filled in. Precedence, highest first:
    the request's own value > the stage file's ``defaults:`` > the engine's
    ``engine_args`` > the engine's built-in value. Unset is None, or no stop
    strings; a layer without a key (TextDefaults has no seed) passes it on."""
    order = (layers.stage, layers.engine, layers.built_in)
    changes: dict[str, Any] = {}
    for name in RequestDefaults.model_fields:
        if getattr(params, name) not in (None, ()):
            continue
        found = (getattr(layer, name, None) for layer in order)
        value = next((v for v in found if v not in (None, ())), None)
        if value is not None:
            changes[name] = value
    return replace(params, **changes) if changes else params
