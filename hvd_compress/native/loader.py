"""Finding, building and loading the native kernels; numpy and ctypes only (no torch).

The kernels (``codecs.cpp``, ``sparse.cpp``, ``select.cpp``, ``lowrank.cpp`` and
``version.cpp``) are compiled when the package is installed, into the extension file
``hvd_compress/native/_kernels*.so`` (see ``setup.py``); :func:`library` loads that file
with :mod:`ctypes`.

Invariants: a library is used only when its ``hvdc_source_hash()`` equals
:func:`source_hash` of the sources beside it (an edited checkout never runs a stale
build), when its CPU record (:mod:`hvd_compress.native.cpu`, read *before* loading) lists
only features this CPU has, and when its own ``hvdc_cpu_features()`` equals that record;
a library without a record is not loaded.

Fallback, with a :class:`RuntimeWarning` saying why and what to do: when the extension is
missing, stale or built for features this CPU lacks, the sources are compiled at run time
with ``g++`` (or ``$HVD_COMPRESS_CXX``) into ``$HVD_COMPRESS_CACHE/native`` (default
``~/.cache/hvd-compress/native``), under a name that hashes the sources, the flags and the
CPU. Should that fail too, a second warning says why and the callers run their torch or
numpy code instead. ``python -m hvd_compress.native build`` rebuilds the installed
extension for this CPU (or for ``$HVD_COMPRESS_MARCH``).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from hvd_compress.native import cpu

HERE = Path(__file__).parent
SOURCES = (HERE / "codecs.cpp", HERE / "sparse.cpp", HERE / "select.cpp",
           HERE / "lowrank.cpp", HERE / "version.cpp")
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
    "onebit_subtract": (), "onebit_reduce": (_c_int64, _c_ptr, _c_ptr),
    "qsgd_subtract": (ctypes.c_int,),
    "qsgd_reduce": (_c_int64, _c_ptr, _c_ptr, ctypes.c_int, ctypes.c_int, ctypes.c_uint64),
    "terngrad_subtract": (), "terngrad_reduce": (_c_int64, _c_ptr, _c_ptr, ctypes.c_double,
                                                 ctypes.c_uint64),
    "onebit_total": (), "qsgd_total": (ctypes.c_int,), "terngrad_total": (),
    "onebit_scaled": (ctypes.c_float,), "qsgd_scaled": (ctypes.c_float, ctypes.c_int),
    "terngrad_scaled": (ctypes.c_float,),
}
"""Each codec kernel's options after the common (input, count, bucket size, output,
threads). The fused error-feedback kernels: ``subtract`` takes decode's, ``reduce`` (payload
count, residual, encoded) then encode's; ``total`` takes decode's (its output one double);
``scaled`` the float factor, then decode's."""

_SPARSE_SIGNATURES: dict[str, tuple] = {
    "varint_decode": (_c_ptr, _c_int64, _c_int64, _c_int64, _c_ptr),
    "varint_nbytes": (_c_ptr, _c_int64),
    "varint_encode": (_c_ptr, _c_int64, _c_ptr),
    "merge_sum": (_c_int64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr),
    "crc32": (_c_int64, _c_ptr, _c_int64),
    "topk": (_c_ptr, _c_int64, _c_ptr, _c_ptr, _c_int64, _c_int64, _c_ptr, _c_ptr),
    "select_largest": (_c_ptr, _c_ptr, _c_int64, _c_int64, _c_ptr, _c_ptr),
    "round": (_c_int64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int64,
              _c_int64, _c_ptr, _c_ptr),
    "frame_encode": (_c_ptr, _c_int64, _c_ptr, _c_ptr, _c_int64, _c_int64, _c_int64, _c_ptr),
    "varint_section": (_c_ptr, _c_int64, _c_ptr),
    "frame_assemble": (_c_ptr, _c_int64, _c_ptr, _c_int64, _c_ptr, _c_int64, _c_ptr),
    "select_magnitude": (_c_ptr, _c_int64, ctypes.c_float, _c_ptr, _c_int64),  # select.cpp
}
"""Argument types of the ``sparse.cpp`` (and ``select.cpp``) kernels that return an int64."""

_OTHER_SIGNATURES: dict[str, tuple] = {
    "lowrank_apply": (_c_ptr, _c_int64, _c_int64, _c_int64, _c_int64, _c_ptr, _c_int64,
                      _c_ptr, ctypes.c_float, ctypes.c_int, ctypes.c_int),  # lowrank.cpp
    "lowrank_right": (_c_ptr, _c_int64, _c_int64, _c_int64, _c_ptr, _c_int64, _c_ptr,
                      _c_int64, _c_int64, ctypes.c_int),
    "lowrank_left": (_c_ptr, _c_int64, _c_int64, _c_int64, _c_int64, _c_ptr, _c_int64,
                     _c_int64, _c_ptr, ctypes.c_int),
}
"""Argument types of the other kernels, which return nothing."""

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


def library_path() -> Path:
    """Where the fallback build for this source, flags and CPU lives (the C ABI does not
    depend on the compiler, so a build outlives the compiler that made it)."""
    key = hashlib.sha256("\0".join([source_hash(), march(), platform.machine(),
                                    cpu.cpu_info().identity()]).encode())
    return cache_dir() / f"hvdc-codecs-{key.hexdigest()[:16]}.so"


def compile_command() -> list[str]:
    """The compiler and flags of a build (without ``-shared``, output and sources)."""
    return [compiler(), *COMPILE_FLAGS, f"-march={march()}", *defines()]


def compile_library(target: Path) -> Path:
    """Compile the kernels into ``target`` with :func:`compile_command`, and write their CPU
    record beside it (:func:`hvd_compress.native.cpu.write_record`). The library is
    compiled next to the target and renamed, so concurrent builders and loaders never see
    a partial file; the record is written first, so a library is never without one.
    ``RuntimeError`` with the compiler's message if compiling fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = compile_command()
        result = subprocess.run([*command, "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES)],
                                capture_output=True, text=True)
        if result.returncode:
            names = " ".join(src.name for src in SOURCES)
            raise RuntimeError(f"compiling {names} failed:\n{result.stderr}")
        cpu.write_record(target, command, march(), source_hash())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build() -> Path:
    """Compile the kernels into the cache unless already there (with their record); return
    the library's path."""
    path = library_path()
    if path.exists() and cpu.read_record(path) is not None:
        return path
    return compile_library(path)


def extension_target() -> Path:
    """Where the extension built at install is, or would be: :func:`installed_path`, else
    ``_kernels<this Python's extension suffix>`` beside this file."""
    return installed_path() or HERE / f"_kernels{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def rebuild_extension() -> Path:
    """Compile the installed extension again, in place, for :func:`march` (``native``: this
    machine's CPU), with its record; what ``python -m hvd_compress.native build`` does.
    Returns its path; ``PermissionError`` naming the folder if it is not writable."""
    target = extension_target()
    if not os.access(target.parent, os.W_OK):
        raise PermissionError(f"cannot write {target.parent}: rebuild as the user who "
                              "installed hvd-compress, or reinstall it (pip install) with "
                              "HVD_COMPRESS_MARCH set")
    return compile_library(target)


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
    for name, argtypes in _OTHER_SIGNATURES.items():
        fn = getattr(lib, f"hvdc_{name}")
        fn.argtypes, fn.restype = list(argtypes), None
    return lib


def _built_hash(lib: ctypes.CDLL) -> str | None:
    try:
        fn = lib.hvdc_source_hash
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    return fn().decode()


def _built_features(lib: ctypes.CDLL) -> list[str] | None:
    """The CPU features the loaded library says it was compiled for (``version.cpp``)."""
    try:
        fn = lib.hvdc_cpu_features
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    return sorted(set(fn().decode().split()))


REINSTALL = "Reinstall the package (pip install .) to build them at install."
REBUILD = ("Rebuild it for this CPU with `python -m hvd_compress.native build`; for an "
           "environment shared by machines of several CPU types, build for their common "
           "features instead: `HVD_COMPRESS_MARCH=x86-64-v2 python -m hvd_compress.native "
           "build` (every x86-64 CPU since about 2009; x86-64-v3 needs AVX2), or reinstall "
           "with HVD_COMPRESS_MARCH set.")


def refusal(path: Path) -> str | None:
    """Why the library at ``path`` must not be loaded on this CPU, from its record alone
    (the library is not opened): it has no record, or the record names CPU features that
    this CPU lacks. ``None`` if it may be loaded."""
    record = cpu.read_record(path)
    if record is None:
        return (f"{path.name} has no record of the CPU features it was built for "
                f"({cpu.record_path(path).name}; built by an older hvd-compress or by "
                "hand), so it is not loaded: it could crash this process with SIGILL")
    lacking = cpu.missing(record["features"])
    if lacking:
        return (f"{path.name} was built (-march={record.get('march')}) for CPU features "
                f"this CPU lacks: {', '.join(lacking)}; it is not loaded, as running it "
                "would crash this process with SIGILL")
    return None


def _mismatch(lib: ctypes.CDLL, path: Path) -> str | None:
    """Why the loaded library at ``path`` must not be used (no kernel of it has run yet):
    it was built from other sources, or its own list of CPU features is not its record."""
    if _built_hash(lib) != source_hash():
        return f"{path.name} was built from other kernel sources than these"
    record, built = cpu.read_record(path), _built_features(lib)
    recorded = None if record is None else sorted(set(record["features"]))
    if built is None or built != recorded:
        return (f"{path.name} is not the build its record {cpu.record_path(path).name} "
                f"describes (CPU features compiled in: {' '.join(built or []) or 'none'}; "
                f"recorded: {' '.join(recorded or []) or 'none'})")
    return None


def _load() -> ctypes.CDLL:
    """The installed extension if it matches the sources and this CPU, else the fallback
    build (which must match this CPU too)."""
    installed = installed_path()
    if installed is None:
        why, advice = ("the native kernels were not compiled when hvd-compress was "
                       "installed"), REINSTALL
    else:
        why = refusal(installed)
        if why is None:
            lib = ctypes.CDLL(str(installed))
            why = _mismatch(lib, installed)
            if why is None:
                return _bind(lib)
        advice = REINSTALL if why.endswith("than these") else REBUILD
    try:
        path = build()
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"{why}. {advice} A run-time build failed too: {err}") from err
    refused = refusal(path)
    if refused is not None:
        raise RuntimeError(f"{why}. {advice} The run-time build is not usable either "
                           f"(HVD_COMPRESS_MARCH={march()}): {refused}")
    warnings.warn(f"hvd_compress: {why}; using a run-time build with {compiler()} ({path}). "
                  f"{advice}", RuntimeWarning, stacklevel=4)
    lib = ctypes.CDLL(str(path))
    mismatch = _mismatch(lib, path)
    if mismatch is not None:
        raise RuntimeError(f"{path}: {mismatch}; delete it to rebuild")
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
