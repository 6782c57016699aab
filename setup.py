"""The one C extension: the GGUF block products, a decode step's float32 glue and its
whole layer stack in one call (services/engines/transformers/_block_kernels.c, the
module, with _block_products.c, _decode_glue.c and _decode_stack.c). Everything else
is in pyproject.toml.

The extension is optional: where no C compiler is found the install still
succeeds, and the transformers engine keeps its float32 weights (it logs why).
OpenMP threads come from the libgomp that torch itself loads (same soname), so the
kernels share torch's thread pool.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "services.engines.transformers._block_kernels",
            sources=[
                "services/engines/transformers/_block_kernels.c",
                "services/engines/transformers/_block_products.c",
                "services/engines/transformers/_decode_glue.c",
                "services/engines/transformers/_decode_stack.c",
            ],
            depends=["services/engines/transformers/_kernels.h"],
            # -ffp-contract=off: (d * q) + m is rounded twice, as gguf-py does, so a
            # dequantised weight is bit for bit the float32 one the plain path loads.
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
