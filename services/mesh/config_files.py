"""Reading YAML config files with errors a person can act on.

Every error names the file, the key path inside it and what was expected, e.g.
``chat.yaml: runtime.max_batch_size: Input should be greater than or equal to 1 (got 0)``.
Shared by stage files and pipeline files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class ConfigError(Exception):
    """A config file that cannot be used; the message is meant for a person."""


def _describe(error: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in error["loc"]) or "(top level)"
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "value_error":
        message = message.removeprefix("Value error, ")
    got = "" if error["type"] in {"missing", "extra_forbidden"} else f" (got {error['input']!r})"
    return f"{path}: {message}{got}"


def validate(model: type[Model], data: Any, source: str) -> Model:
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{source}: expected a mapping of settings, got {kind}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {_describe(e)}" for e in exc.errors()]  # type: ignore[arg-type]
        raise ConfigError("\n".join(lines)) from None


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
