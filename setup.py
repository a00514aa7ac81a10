"""The compiled codec kernels (psgrad/codecs/_kernels.c); everything else is in setup.cfg.

``optional=True``: where no C compiler is found the install goes on and psgrad runs its numpy
kernels (``psgrad codecs`` says which ones run)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "psgrad.codecs._kernels",
            ["psgrad/codecs/_kernels.c"],
            # no fused multiply-add: the kernels must round as numpy does, product then sum
            extra_compile_args=["-O3", "-ffp-contract=off", "-std=c11"],
            optional=True,
        )
    ]
)
