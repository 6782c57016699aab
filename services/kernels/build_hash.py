"""The kernels' build hash: the sources and the torch they were built against.

``setup.py`` compiles it into the library (``OMNI_KERNELS_HASH``); at load the
library's hash is compared with the sources beside it, so a build older than its
sources is refused by name instead of running stale code. Plain Python without
torch: setup.py imports it before anything is built.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
REBUILD = "pip install --no-build-isolation -e ."  # what rebuilds the kernels in place
_SUFFIXES = {".cpp", ".h"}


def sources(root: Path = CSRC) -> list[Path]:
    """Every file the library is built from, in a fixed order."""
    return sorted(p for p in root.rglob("*") if p.suffix in _SUFFIXES)


def source_hash(torch_version: str, root: Path = CSRC) -> str:
    """A digest of the sources (paths and bytes) and the torch version."""
    digest = hashlib.sha256(torch_version.encode())
    for path in sources(root):
        digest.update(b"\0" + path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def stale(built: str, torch_version: str, root: Path = CSRC) -> str | None:
    """Why a library built as ``built`` must not run with the sources in ``root`` and
    this torch, or None (also where there are no sources to compare: a wheel)."""
    if not sources(root):
        return None
    expected = source_hash(torch_version, root)
    if built == expected:
        return None
    return (
        f"the CPU kernels were built from other sources or against another torch (build "
        f"{built}, sources and torch {torch_version}: {expected}); rebuild: {REBUILD}"
    )
