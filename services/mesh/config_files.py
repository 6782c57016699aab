"""Reading YAML config files with errors a person can act on, and ``Frozen``, the
base of every config model in the project.

Every error names the file, the key path inside it and what was expected, e.g.
``chat.yaml: runtime.max_batch_size: Input should be greater than or equal to 1 (got 0)``.
Shared by stage files, pipeline files, security settings, token files and the
engines' ``engine_args``.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

Model = TypeVar("Model", bound=BaseModel)

_UNKNOWN_KEY = "unknown_key"


class ConfigError(Exception):
    """A config file that cannot be used; the message is meant for a person."""


def _types(annotation: Any) -> set[Any]:
    """The types a field annotation admits (unions and Annotated unwrapped)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _types(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return set().union(*(_types(arg) for arg in get_args(annotation)))
    return {annotation}


class Frozen(BaseModel):
    """A config model: immutable, and a key it does not know is an error that
    lists the keys it does know."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_only_for_flags(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would take YAML's true/false as 1/0 (max_batch_size: true), and
        # "yes" or 1 as a flag.
        if info.field_name is None or value is None:
            return value
        admits = _types(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and bool not in admits and admits & {int, float}:
            raise ValueError("expected a number, not true/false")
        if not isinstance(value, bool) and bool in admits and admits <= {bool, type(None)}:
            raise ValueError("expected true or false")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _name_the_known_keys(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            if not any(_unknown_here(error) for error in exc.errors()):
                raise
            known = ", ".join(f.alias or name for name, f in cls.model_fields.items())
            raise _with_known_keys(exc, known) from None


def _unknown_here(error: Any) -> bool:
    """A key the model being validated does not have (not one of a nested model)."""
    return bool(error["type"] == "extra_forbidden" and len(error["loc"]) == 1)


def _with_known_keys(exc: ValidationError, known: str) -> ValidationError:
    details = []
    for error in exc.errors():
        if _unknown_here(error):
            kind = PydanticCustomError(
                _UNKNOWN_KEY, "unknown key; expected one of {known}", {"known": known}
            )
        else:  # as it was: its own type and message
            kind = PydanticCustomError(error["type"], "{message}", {"message": error["msg"]})
        details.append(InitErrorDetails(type=kind, loc=error["loc"], input=error["input"]))
    return ValidationError.from_exception_data(exc.title, details)


def describe(exc: ValidationError, at: str = "") -> list[str]:
    """One line per problem: ``key.path: what was expected (got value)``; ``at``
    is the path of the validated mapping inside its file."""
    return [_describe(error, at) for error in exc.errors()]  # type: ignore[arg-type]


def _describe(error: dict[str, Any], at: str) -> str:
    path = ".".join([*([at] if at else []), *(str(part) for part in error["loc"])])
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "value_error":
        message = message.removeprefix("Value error, ")
    quiet = {"missing", "extra_forbidden", _UNKNOWN_KEY}
    got = "" if error["type"] in quiet else f" (got {error['input']!r})"
    return f"{path or '(top level)'}: {message}{got}"


def validate(model: type[Model], data: Any, source: str) -> Model:
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{source}: expected a mapping of settings, got {kind}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(f"{source}: {line}" for line in describe(exc))) from None


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: expected UTF-8 text, found byte 0x{exc.object[exc.start]:02x} "
            f"at offset {exc.start}"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None


def load(model: type[Model], path: str | Path) -> Model:
    path = Path(path)
    return validate(model, read_yaml(path), str(path))
