"""Build hook for the native parts: the metadata lives in setup.cfg.

The storage format's hot paths in ``logbroker/storage/_speedups.c`` (batch encoder, record
checks, fetch transcoding), the shared flush's thread in ``logbroker/storage/_syncthread.c`` and
the client protocol's record decoder in ``logbroker/wire/_speedups.c`` are optional: where they
cannot be built (no compiler or Python headers), the install still succeeds and the broker uses
their Python references, which give the same results more slowly. ``scripts/install`` installs
the compiler.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "logbroker.storage._speedups",
            sources=["logbroker/storage/_speedups.c"],
            depends=["logbroker/wire/_wire_record.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        ),
        Extension(
            "logbroker.storage._syncthread",
            sources=["logbroker/storage/_syncthread.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        ),
        Extension(
            "logbroker.wire._speedups",
            sources=["logbroker/wire/_speedups.c"],
            depends=["logbroker/wire/_wire_record.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        ),
    ]
)
