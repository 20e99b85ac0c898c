"""Finding, building and loading the native kernels; numpy and ctypes only (no torch).

The kernels (``codecs.cpp``, ``sparse.cpp`` and ``version.cpp``) are compiled when the
package is installed, into the extension file ``hvd_compress/native/_kernels*.so`` (see
``setup.py``); :func:`library` loads that file with :mod:`ctypes`. Its
``hvdc_source_hash()`` must equal :func:`source_hash` of the sources beside it, so a build
from other sources (an edited checkout) is never used.

Fallback, with a :class:`RuntimeWarning` saying so: when the extension is missing or
stale, the sources are compiled at run time with the system C++ compiler (``g++``, or
``$HVD_COMPRESS_CXX``) into ``$HVD_COMPRESS_CACHE/native`` (default
``~/.cache/hvd-compress/native``), under a name that hashes the sources, the flags and the
CPU, so an edit or another machine gets its own build. Should that fail too, a second
warning says why and the callers run their torch or numpy code instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import importlib.util
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "codecs.cpp", HERE / "sparse.cpp", HERE / "version.cpp")
COMPILE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-std=c++17")
"""``-ffp-contract=off``: no fused multiply-adds, so the float32 arithmetic of every code
is the torch reference's, operation for operation. ``-march`` comes from :func:`march`."""
LINK_FLAGS = ("-fopenmp",)
EXTENSION = "hvd_compress.native._kernels"
"""The compiled extension built at install (a plain C library, loaded with ctypes)."""

_c_int64, _c_ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES: dict[str, tuple] = {
    "onebit_encode": (), "onebit_decode": (),
    "qsgd_encode": (ctypes.c_int, ctypes.c_int, ctypes.c_uint64), "qsgd_decode": (ctypes.c_int,),
    "terngrad_encode": (ctypes.c_double, ctypes.c_uint64), "terngrad_decode": (),
}
"""Each codec kernel's options after the common (input, count, bucket size, output,
threads)."""

_SPARSE_SIGNATURES: dict[str, tuple] = {
    "varint_decode": (_c_ptr, _c_int64, _c_int64, _c_int64, _c_ptr),
    "varint_nbytes": (_c_ptr, _c_int64),
    "varint_encode": (_c_ptr, _c_int64, _c_ptr),
    "merge_sum": (_c_int64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr),
    "crc32": (_c_int64, _c_ptr, _c_int64),
}
"""Argument types of the ``sparse.cpp`` kernels that return an int64."""

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
_disabled = contextvars.ContextVar("hvd_compress_native_disabled", default=False)


def march() -> str:
    """The ``-march`` target: ``$HVD_COMPRESS_MARCH``, default ``native`` (the building
    host's CPU; set e.g. ``x86-64-v3`` to build for a cluster from another machine)."""
    return os.environ.get("HVD_COMPRESS_MARCH", "native")


def source_hash() -> str:
    """16 hex digits identifying the kernel sources and compile flags (not the CPU)."""
    texts = [src.read_text() for src in SOURCES if src.name != "version.cpp"]
    return hashlib.sha256("\0".join([*texts, " ".join(COMPILE_FLAGS)]).encode()
                          ).hexdigest()[:16]


def defines() -> tuple[str, ...]:
    """Preprocessor definitions every build passes: the :func:`source_hash`."""
    return (f'-DHVDC_SOURCE_HASH="{source_hash()}"',)


def compiler() -> str:
    """The C++ compiler of the fallback build: ``$HVD_COMPRESS_CXX`` or ``g++``."""
    return os.environ.get("HVD_COMPRESS_CXX", "g++")


def cache_dir() -> Path:
    """Where fallback builds are kept: ``$HVD_COMPRESS_CACHE/native``, else
    ``~/.cache/hvd-compress/native``."""
    root = os.environ.get("HVD_COMPRESS_CACHE") or Path.home() / ".cache" / "hvd-compress"
    return Path(root) / "native"


def _cpu_identity() -> str:
    """The CPU's model and feature flags, which ``-march=native`` builds for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def library_path() -> Path:
    """Where the fallback build for this source, flags and CPU lives (the C ABI does not
    depend on the compiler, so a build outlives the compiler that made it)."""
    key = hashlib.sha256("\0".join([source_hash(), march(), platform.machine(),
                                    _cpu_identity()]).encode())
    return cache_dir() / f"hvdc-codecs-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels into the cache unless already there; return the library's path."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compile next to the target and rename: concurrent builders never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler(), *COMPILE_FLAGS, f"-march={march()}", *defines(),
                                 "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES)],
                                capture_output=True, text=True)
        if result.returncode:
            names = " ".join(src.name for src in SOURCES)
            raise RuntimeError(f"compiling {names} failed:\n{result.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def installed_path() -> Path | None:
    """The extension file built at install, or ``None`` if the package has none."""
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, options in _SIGNATURES.items():
        fn = getattr(lib, f"hvdc_{name}")
        fn.argtypes = [_c_ptr, _c_int64, _c_int64, _c_ptr, ctypes.c_int, *options]
        fn.restype = None
    for name, argtypes in _SPARSE_SIGNATURES.items():
        fn = getattr(lib, f"hvdc_{name}")
        fn.argtypes, fn.restype = list(argtypes), _c_int64
    return lib


def _built_hash(lib: ctypes.CDLL) -> str | None:
    try:
        fn = lib.hvdc_source_hash
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    return fn().decode()


def _load() -> ctypes.CDLL:
    """The installed extension if it matches the sources, else the fallback build."""
    installed = installed_path()
    if installed is None:
        why = "the native kernels were not compiled when hvd-compress was installed"
    else:
        lib = ctypes.CDLL(str(installed))
        if _built_hash(lib) == source_hash():
            return _bind(lib)
        why = f"{installed.name} was built from other kernel sources than these"
    path = build()
    warnings.warn(f"hvd_compress: {why}; using a run-time build with {compiler()} ({path}). "
                  "Reinstall the package (pip install .) to build them at install.",
                  RuntimeWarning, stacklevel=4)
    lib = ctypes.CDLL(str(path))
    if _built_hash(lib) != source_hash():
        raise RuntimeError(f"{path} does not match the kernel sources; delete it to rebuild")
    return _bind(lib)


def library() -> ctypes.CDLL | None:
    """The loaded kernels (found or built on first use); ``None``, with a warning, if
    neither the installed extension nor a run-time build is usable."""
    global _library, _failure
    if _library is None and _failure is None:
        with _lock:
            if _library is None and _failure is None:
                try:
                    _library = _load()
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    _failure = str(err)
                    warnings.warn(f"hvd_compress: native kernels unavailable, CPU tensors and "
                                  f"sparse frames take the slower torch/numpy code: {err}",
                                  RuntimeWarning, stacklevel=2)
    return _library


def available() -> bool:
    """Whether the kernels are loaded and not :func:`disabled` in this thread."""
    return not _disabled.get() and library() is not None


def is_disabled() -> bool:
    """Whether :func:`disabled` is in force in this thread."""
    return _disabled.get()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block (in this thread), CPU tensors take the torch code, as on a GPU, and
    sparse frames the numpy code."""
    token = _disabled.set(True)
    try:
        yield
    finally:
        _disabled.reset(token)
