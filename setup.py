"""Builds the native kernels at install as the extension ``hvd_compress.native._kernels``.

Everything else about the package is in ``pyproject.toml``. The extension is a plain C
library (``extern "C"`` kernels, no Python module init) that
:mod:`hvd_compress.native.loader` loads with ctypes; its compile flags and source hash
come from that module, imported here from the source tree (it and
:mod:`hvd_compress.native.cpu` use the standard library only, so the build imports no
dependency). Beside the library the build writes the record of the CPU features it was
compiled for (``_kernels*.so.cpu.json``, :func:`hvd_compress.native.cpu.write_record`),
which the loader checks against the running CPU before loading it. The extension is
optional: without a C++ compiler the install still succeeds, and the kernels are compiled
at first use instead (with a warning saying so). ``HVD_COMPRESS_MARCH`` picks the
``-march`` target (default ``native``: the installing host's CPU; ``x86-64-v2`` for an
environment shared by machines of several CPU types).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
from hvd_compress.native import cpu, loader  # noqa: E402  (the tree's, stdlib only)


class BuildExt(build_ext):
    """``build_ext`` that writes each built library's CPU record beside it, and copies it
    with the library for in-place (editable) builds."""

    def build_extension(self, ext: Extension) -> None:
        super().build_extension(ext)
        path = Path(self.get_ext_fullpath(ext.name))
        if not path.exists():  # an optional extension that failed to build
            return
        command = [*self.compiler.compiler_so, *ext.extra_compile_args]
        try:
            cpu.write_record(path, command, loader.march(), loader.source_hash())
        except (OSError, RuntimeError) as err:  # the loader then refuses it, and says so
            print(f"warning: no CPU record written for {path.name}: {err}", file=sys.stderr)

    def copy_extensions_to_source(self) -> None:
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace, regular = map(Path, self._get_inplace_equivalent(build_py, ext))
            if cpu.record_path(regular).exists():
                shutil.copyfile(cpu.record_path(regular), cpu.record_path(inplace))


setup(cmdclass={"build_ext": BuildExt}, ext_modules=[Extension(
    "hvd_compress.native._kernels",
    sources=[str(src.relative_to(ROOT)) for src in loader.SOURCES],
    extra_compile_args=[*loader.COMPILE_FLAGS, f"-march={loader.march()}",
                        *loader.defines()],
    extra_link_args=list(loader.LINK_FLAGS),
    language="c++",
    optional=True,
)])
