"""Loading the kernels library once, and which variant of it runs.

The library (``_ops*.so``, built by ``pip install --no-build-isolation -e .``)
registers ``torch.ops.omni_kernels``. It is optional: where no C++ compiler or
OpenMP was found, the install still succeeds without it, and ``unavailable`` says
why (the engines then say so once at start, with what it costs). A library built
from other sources or against another torch is refused here, naming the rebuild
command, rather than run.

Every variant the build has (``reference``, then ``avx2``, ``avx512`` and
``avx512vnni`` on x86-64)
is in the one library; the best this CPU runs is chosen once, at load, unless
``OMNI_KERNELS`` names another (one the CPU cannot run is refused, naming what it
lacks). ``variant()`` is the capability the engines and the tests both read.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from services.kernels.build_hash import REBUILD, stale
from services.kernels.ops_face import KernelOps
from services.mesh import environment

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent


class KernelsUnavailable(RuntimeError):
    """The kernels cannot run here; the message says why and what to do."""


@functools.cache
def _load() -> tuple[Any, str | None]:
    """(torch.ops.omni_kernels, None), or (None, why not)."""
    forced = environment.KERNELS.get()  # a bad value is refused before anything loads
    path = environment.KERNELS_LIBRARY.get() or next(iter(sorted(_HERE.glob("_ops*.so"))), None)
    if path is None:
        return None, (
            "the CPU kernels were not built (a C++ compiler with OpenMP, and torch, are "
            f"needed at install: {REBUILD})"
        )
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        return None, f"the CPU kernels in {path} do not load ({exc}); rebuild: {REBUILD}"
    ops = torch.ops.omni_kernels
    why = stale(str(ops.build_hash()), torch.__version__)
    if why is not None:
        return None, why
    if forced is not None:
        try:
            use(forced, ops)
        except KernelsUnavailable as exc:
            return None, f"{environment.KERNELS.name}={forced}: {exc}"
    return ops, None


def unavailable() -> str | None:
    """Why the kernels cannot run here, or None when they can."""
    return _load()[1]


def ops() -> KernelOps:
    """``torch.ops.omni_kernels``, typed (ops_face.py); raises ``KernelsUnavailable``
    where it cannot run."""
    loaded, why = _load()
    if loaded is None:
        raise KernelsUnavailable(why)
    return cast(KernelOps, loaded)


def variant() -> str:
    """The variant that runs: "avx512vnni", "avx512", "avx2", "reference", or "none"
    (not built)."""
    loaded = _load()[0]
    return "none" if loaded is None else str(loaded.variant())


def runnable() -> list[str]:
    """The variants this build has that this CPU runs, best first (none if not built)."""
    loaded = _load()[0]
    return [] if loaded is None else [v for v in loaded.variants() if loaded.supports(v)]


def build_variants() -> list[str]:
    """Every variant this build has, runnable here or not, best first."""
    loaded = _load()[0]
    return [] if loaded is None else list(loaded.variants())


def lacks(name: str) -> str:
    """The instruction sets variant ``name`` needs (what a CPU that cannot run it lacks)."""
    return str(ops().needs(name))


def use(name: str, loaded: KernelOps | None = None) -> None:
    """Run ``name`` from now on; ``KernelsUnavailable`` names what the CPU lacks."""
    kernels = ops() if loaded is None else loaded
    if name not in kernels.variants():
        raise KernelsUnavailable(f"kernel variant {name}: this build has {kernels.variants()}")
    if not kernels.supports(name):
        raise KernelsUnavailable(
            f"kernel variant {name}: this CPU lacks {kernels.needs(name)}, which it needs"
        )
    kernels.use(name)


@contextmanager
def using(name: str) -> Iterator[None]:
    """Run ``name`` inside the block (the tests run every variant the CPU has)."""
    before = variant()
    use(name)
    try:
        yield
    finally:
        use(before)


def describe() -> str:
    """One line for a stage's start and Describe: the variant and what it needs, or why
    none runs."""
    why = unavailable()
    if why is not None:
        return f"none: {why}"
    kernels = ops()
    name = variant()
    return f"{name} ({kernels.needs(name)})" if name != "reference" else "reference (plain C++)"
