"""Builds the native kernels at install as the extension ``hvd_compress.native._kernels``.

Everything else about the package is in ``pyproject.toml``. The extension is a plain C
library (``extern "C"`` kernels, no Python module init) that
:mod:`hvd_compress.native.loader` loads with ctypes; its compile flags and source hash
come from that module, read here by path so the build imports no dependency. The extension
is optional: without a C++ compiler the install still succeeds, and the kernels are
compiled at first use instead (with a warning saying so). ``HVD_COMPRESS_MARCH`` picks the
``-march`` target (default ``native``: the installing host's CPU).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location(
    "_hvdc_loader", Path(__file__).parent / "hvd_compress" / "native" / "loader.py")
loader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loader)

setup(ext_modules=[Extension(
    "hvd_compress.native._kernels",
    sources=[str(src.relative_to(Path(__file__).parent)) for src in loader.SOURCES],
    extra_compile_args=[*loader.COMPILE_FLAGS, f"-march={loader.march()}",
                        *loader.defines()],
    extra_link_args=list(loader.LINK_FLAGS),
    language="c++",
    optional=True,
)])
