"""The optional C helper of graphrt.Step (graphrt/_fast.c): built where a C compiler is
available, otherwise skipped (``optional=True``), and Step keeps its Python checks."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("graphrt._fast", ["graphrt/_fast.c"], optional=True, libraries=["dl"],
                             extra_compile_args=["-O3", "-Wall"])])
