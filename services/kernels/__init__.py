"""The CPU kernels: GGUF block products (on float32 activations, or on activations
rounded to 8 bits with integer dot products), a decoder layer's float32 glue, and a
decode step's whole layer stack.

C++ in ``csrc/``, laid out as ggml-cpu is: reference functions in one file, each
instruction set's variant in its own (``x86/avx2.cpp``, ``x86/avx512.cpp``, the
latter's VNNI products in ``x86/avx512_vnni.cpp``), one
header; the best variant the CPU runs is picked once at load. They are torch ops
(``torch.ops.omni_kernels``: ``block_linear``, ``quantize_q8``, ``block_dequantize``, ``rms_norm``,
``silu_mul``, ``rotary_``, ``attend_one``, ``decode_stack`` over a ``DecodeStack``)
that take tensors and check them. ``library.py`` loads them and says which variant
runs, or why none does; ``ops_face.py`` is their typed face (``ops()`` returns it),
and ``stack.py`` builds a ``DecodeStack`` from named layers, checked by role.
"""

from __future__ import annotations

from services.kernels.library import (
    KernelsUnavailable,
    describe,
    ops,
    runnable,
    unavailable,
    use,
    using,
    variant,
)

__all__ = [
    "KernelsUnavailable",
    "describe",
    "ops",
    "runnable",
    "unavailable",
    "use",
    "using",
    "variant",
]
