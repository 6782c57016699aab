"""The one compiled part: the CPU kernels (services/kernels/csrc), a library of torch
ops (torch.ops.omni_kernels) built against the torch installed in this environment.
Everything else is in pyproject.toml.

Install with ``pip install --no-build-isolation`` (torch already installed): the
kernels must be built against the very torch that loads them, which an isolated
build environment would not have. They need a C++20 compiler with OpenMP (g++ and
libgomp). Without either, or without torch, the install still succeeds and says so
here; the engines then run without the kernels and say so at every start (a GGUF
model on the float32 path, several times slower).

OpenMP threads come from the libgomp that torch itself loads (same soname), so the
kernels share torch's thread pool. -ffp-contract=off: (d * q) + m is rounded twice,
as gguf-py does, so a dequantised weight is bit for bit the float32 the plain path
loads.
"""

import os
import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "services" / "kernels"))
from build_hash import CSRC, REBUILD, source_hash, sources

NOT_BUILT = "\n*** omni-mesh: the CPU kernels were NOT built ({why}).\n*** {rebuild}\n"


def kernels() -> dict:
    if os.environ.get("OMNI_KERNELS") == "in-tree":
        # An editable install beside another venv's (.ci/vllm-env.sh in CI, with the
        # same torch): the kernels that install builds in place are this one's too.
        print("omni-mesh: the CPU kernels are the source tree's own build (OMNI_KERNELS)")
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(NOT_BUILT.format(why="torch is not importable while building", rebuild=REBUILD))
        return {}

    class BuildKernels(BuildExtension):
        """Optional for real: a failed compile is reported, never an install failure."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                print(NOT_BUILT.format(why=exc, rebuild=f"fix that, then {REBUILD}"))

    files = [str(p.relative_to(Path(__file__).resolve().parent)) for p in sources(CSRC)]
    return {
        "ext_modules": [
            CppExtension(
                "services.kernels._ops",
                sources=[f for f in files if f.endswith(".cpp")],
                depends=[f for f in files if f.endswith(".h")],
                extra_compile_args=[
                    "-O3",
                    "-fopenmp",
                    "-ffp-contract=off",
                    "-std=c++20",
                    "-Wno-maybe-uninitialized",  # GCC 12's own AVX-512 reduce headers
                    f"-DOMNI_KERNELS_HASH={source_hash(torch.__version__)}",
                ],
                extra_link_args=["-fopenmp"],
            )
        ],
        "cmdclass": {"build_ext": BuildKernels.with_options(no_python_abi_suffix=True)},
    }


setup(**kernels())
