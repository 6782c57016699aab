"""Which kernels run: the best variant this CPU has unless OMNI_KERNELS names another,
one it cannot run refused naming what it lacks, a stale build refused naming the
rebuild command, and the reference-only build (OMNI_GENERIC_KERNELS: what a CPU with
neither AVX2 nor AVX-512, or another architecture, gets) passing these same tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services import kernels
from services.kernels import library
from services.kernels.build_hash import CSRC, REBUILD, source_hash, sources, stale
from tests.conftest import REPO


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    # A fresh process whose only OMNI_KERNELS is the one given (the suite itself may
    # run under OMNI_KERNELS=avx2 to try the AVX2 variant on an AVX-512 machine).
    base = {k: v for k, v in os.environ.items() if k != "OMNI_KERNELS"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**base, **env},
    )  # fmt: skip


def test_the_best_variant_this_cpu_runs_is_the_one_in_use() -> None:
    runnable = kernels.runnable()
    assert runnable == [v for v in library.build_variants() if v in runnable]  # best first
    assert runnable[-1] == "reference"  # every CPU runs the reference
    fresh = _python("from services import kernels; print(kernels.variant())")
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.strip() == runnable[0]
    if "OMNI_KERNELS" not in os.environ:
        assert kernels.describe().startswith(runnable[0])


def test_omni_kernels_picks_another_variant() -> None:
    forced = _python(
        "from services import kernels; print(kernels.variant())", OMNI_KERNELS="reference"
    )
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == "reference"


def test_an_unknown_variant_is_refused_naming_the_variable() -> None:
    bad = _python("from services import kernels; kernels.unavailable()", OMNI_KERNELS="sse2")
    assert bad.returncode != 0
    expected = "OMNI_KERNELS: expected one of reference, avx2, avx512, avx512vnni, got 'sse2'"
    assert expected in bad.stderr


@pytest.mark.parametrize("name", library.build_variants() or ["none"])
def test_a_variant_the_cpu_lacks_is_refused_naming_what_it_needs(name: str) -> None:
    if name in kernels.runnable():
        with kernels.using(name):
            assert kernels.variant() == name
        return
    with pytest.raises(kernels.KernelsUnavailable, match=f"this CPU lacks {library.lacks(name)}"):
        kernels.use(name)
    forced = _python(
        "from services import kernels; print(kernels.unavailable())", OMNI_KERNELS=name
    )
    assert f"OMNI_KERNELS={name}: kernel variant {name}: this CPU lacks" in forced.stdout


def test_a_build_older_than_its_sources_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    built = source_hash(torch.__version__, copy)
    assert stale(built, torch.__version__, copy) is None
    assert stale(str(kernels.ops().build_hash()), torch.__version__) is None  # this build
    edited = copy / "x86" / "avx2.cpp"
    edited.write_text(edited.read_text() + "\n/* edited */\n")
    why = stale(built, torch.__version__, copy)
    assert why is not None and f"rebuild: {REBUILD}" in why
    assert "another torch" in (stale(built, "2.0.0", tmp_path / "none") or "another torch")
    assert stale(built, "2.0.0", copy) is not None  # built against another torch


@pytest.mark.slow
def test_the_reference_only_build_passes_the_kernel_tests(tmp_path: Path) -> None:
    """Built with -DOMNI_GENERIC_KERNELS (no x86 file compiled in), loaded through
    OMNI_KERNELS_LIBRARY, the kernel tests pass on its one variant."""
    build = _python(
        "import sys, torch; from torch.utils import cpp_extension as c; "
        f"c.load('omni_kernels_reference', {[str(p) for p in sources() if p.suffix == '.cpp']!r}, "
        f"extra_cflags=['-O2', '-fopenmp', '-ffp-contract=off', '-std=c++20', "
        f"'-DOMNI_GENERIC_KERNELS', '-DOMNI_KERNELS_HASH={source_hash(torch.__version__)}'], "
        f"extra_ldflags=['-fopenmp'], build_directory={str(tmp_path)!r}, is_python_module=False)",
        MAX_JOBS="2",
    )
    assert build.returncode == 0, build.stderr[-3000:]
    library_file = tmp_path / "omni_kernels_reference.so"
    assert library_file.is_file()
    here = Path(__file__).parent
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here),
         "-k", "not reference_only_build", "-W", "ignore::pytest.PytestUnraisableExceptionWarning"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if k != "OMNI_KERNELS"},
             "OMNI_KERNELS_LIBRARY": str(library_file), "CI": "true"},
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:]
    only = _python(
        "from services import kernels; print(kernels.runnable(), kernels.variant())",
        OMNI_KERNELS_LIBRARY=str(library_file),
    )
    assert only.stdout.strip() == "['reference'] reference", only.stderr
