"""Which of vLLM's CPU kernel builds runs here, decided before vLLM loads any of them.

vLLM's CPU wheel carries three builds of its kernels and imports one at run time
(``CpuPlatform.import_kernels``): ``_C`` (AVX-512 with BF16), ``_C_AVX512`` (AVX-512)
and ``_C_AVX2``. Importing a build the CPU cannot run kills the process with SIGILL,
so nothing here imports one by name: ``kernels`` says, from the same torch checks
vLLM makes, which it will load, and ``refuses`` says why none can run (a CPU with
neither AVX2 nor AVX-512), so the engine refuses at start instead of crashing.
"""

from __future__ import annotations

import torch


def kernels() -> str:
    """The build vLLM imports on this CPU, as vLLM 0.32's CpuPlatform picks it."""
    if torch.cpu._is_avx512_supported():
        if torch.cpu._is_avx512_bf16_supported():
            return "_C (AVX-512 with BF16)"
        return "_C_AVX512 (AVX-512)"
    return "_C_AVX2 (AVX2)"


def refuses() -> str | None:
    """Why vLLM's CPU build cannot run here, or None."""
    if torch.cpu._is_avx512_supported() or torch.cpu._is_avx2_supported():
        return None
    return (
        "vLLM's CPU build needs AVX2 or AVX-512, and this CPU has neither (its kernels "
        "would die with SIGILL)"
    )
