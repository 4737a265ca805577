"""The one C extension (the read-ahead helpers, connectors/store/_readpool.c, with xxHash
vendored in connectors/store/vendor); everything else about the package is declared in
pyproject.toml. The extension is optional: where no C compiler (or no Python headers) is
found, the build says so and goes on, and encache reads and checksums each load on one
thread instead (connectors/store/read_ahead.py; same results, one warning at run time)."""

import platform

from setuptools import Extension, setup

VENDOR = "connectors/store/vendor"
# x86: xxHash's run-time choice of SSE2 / AVX2 / AVX-512 (other CPUs: xxhash.h alone)
DISPATCH = ([f"{VENDOR}/xxh_x86dispatch.c"]
            if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else [])

setup(ext_modules=[Extension("encache.connectors.store._readpool",
                             ["connectors/store/_readpool.c", *DISPATCH],
                             depends=[f"{VENDOR}/xxhash.h", f"{VENDOR}/xxh_x86dispatch.h"],
                             extra_compile_args=["-O2", "-Wall"], optional=True)])
