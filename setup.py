"""The one C extension (the read-ahead helpers, connectors/store/_readpool.c); everything
else about the package is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("encache.connectors.store._readpool",
                             ["connectors/store/_readpool.c"],
                             extra_compile_args=["-O2", "-Wall"])])
