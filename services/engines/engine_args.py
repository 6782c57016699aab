"""``engine_args``: the base of every engine's settings model, and how an engine
gets its own.

An engine class names its model (``settings_model``; registry.settings_model
finds it by engine name). A stage validates the stage file's ``engine_args``
with it when it loads the file, so a bad key or value stops the stage (exit 2)
with the file, the key path and what was expected; the engine then receives the
model itself. An engine built directly (tests, benchmarks) from a plain mapping
validates it here, with the same messages, raised as ``InitFailed``. Validators
that depend on the rest of the stage file (load_format, the device) read it from
``StageFacts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError, ValidationInfo

from services.engines.base import EngineSettings, LoadFormat
from services.mesh import config_files
from services.mesh.config_files import Frozen
from services.mesh.errors import InitFailed

Args = TypeVar("Args", bound="EngineArgs")


@dataclass(frozen=True)
class StageFacts:
    """What the stage file says besides ``engine_args`` that an engine's settings
    may depend on (the validation context)."""

    device: str = "cpu"
    dtype: str | None = None
    load_format: LoadFormat = "auto"

    @classmethod
    def of(cls, info: ValidationInfo) -> StageFacts:
        return info.context if isinstance(info.context, StageFacts) else cls()


class EngineArgs(Frozen):
    """The ``engine_args`` of one engine: its subclass is the engine's ``settings_model``."""

    @classmethod
    def of(cls: type[Args], settings: EngineSettings) -> Args:
        """This engine's settings: as the stage validated them, or validated now."""
        given = settings.engine_args
        if isinstance(given, cls):
            return given
        if isinstance(given, BaseModel):
            raise InitFailed(
                f"engine_args: {type(given).__name__} given where {cls.__name__} belongs",
                field="engine_args",
            )
        facts = StageFacts(settings.device, settings.dtype, settings.load_format)
        try:
            return cls.model_validate(dict(given), context=facts)
        except ValidationError as exc:
            first = ".".join(["engine_args", *map(str, exc.errors()[0]["loc"])])
            lines = config_files.describe(exc, "engine_args")
            raise InitFailed("\n".join(lines), field=first) from None


def from_stage_file(
    model: type[EngineArgs] | None, raw: Any, facts: StageFacts
) -> EngineArgs | dict[str, Any]:
    """A stage file's ``engine_args`` for an engine whose settings model is ``model``
    (None: a plug-in that takes a plain mapping); pydantic's ValidationError when
    they do not fit, which the stage file's loader turns into file: key: message."""
    if model is not None:
        return model.model_validate(raw, context=facts)
    if not isinstance(raw, dict):
        raise ValueError("expected a mapping of settings")
    return raw
