"""Build hook for the one native part: the metadata lives in setup.cfg.

The batch encoder in ``logbroker/storage/_speedups.c`` is optional: where it cannot be built (no
compiler or Python headers), the install still succeeds and the storage engine uses its Python
encoder, which writes the same bytes more slowly. ``scripts/install`` installs the compiler.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "logbroker.storage._speedups",
            sources=["logbroker/storage/_speedups.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        )
    ]
)
