"""Native CPU kernels, compiled once and cached: the packed codecs (``codecs.cpp``) and
the parameter server's sparse index coding and aggregation (``sparse.cpp``, used through
:mod:`hvd_compress.native.sparse`).

Each encode or decode of a CPU tensor is one fused pass over the data in C++ (OpenMP, with
torch's intra-op thread count), writing the layouts of :mod:`hvd_compress.wire` bit for
bit; tensors on other devices take the schemes' torch code. The shared library is built
with the system C++ compiler (``g++``, or ``$HVD_COMPRESS_CXX``) into
``$HVD_COMPRESS_CACHE/native`` (default ``~/.cache/hvd-compress/native``), under a name
that hashes the sources, the flags and the CPU, so an edit or another machine gets its own
build; ``scripts/install.sh`` builds it (``python -m hvd_compress.native``).
Should the build fail at run time, a warning says why and the torch code runs instead.

It is called through :mod:`ctypes` with the tensors' data pointers; ctypes releases the GIL
for the call, so ranks run on threads encode in parallel. Payloads and decoded values are
written into :func:`~hvd_compress.native.buffers.empty` memory (recycled for large ones).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from hvd_compress.native.buffers import empty

__all__ = ["active", "available", "build", "decode", "disabled", "empty", "encode", "library",
           "seed"]

SOURCES = (Path(__file__).with_name("codecs.cpp"), Path(__file__).with_name("sparse.cpp"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp",
         "-std=c++17", "-shared", "-fPIC")
"""``-ffp-contract=off``: no fused multiply-adds, so the float32 arithmetic of every code
is the torch reference's, operation for operation."""

_c_int64, _c_ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES: dict[str, tuple] = {
    "onebit_encode": (), "onebit_decode": (),
    "qsgd_encode": (ctypes.c_int, ctypes.c_int, ctypes.c_uint64), "qsgd_decode": (ctypes.c_int,),
    "terngrad_encode": (ctypes.c_double, ctypes.c_uint64), "terngrad_decode": (),
}
"""Each kernel's options after the common (input, count, bucket size, output, threads)."""

_SPARSE_SIGNATURES: dict[str, tuple] = {
    "varint_decode": (_c_ptr, _c_int64, _c_int64, _c_int64, _c_ptr),
    "varint_nbytes": (_c_ptr, _c_int64),
    "varint_encode": (_c_ptr, _c_int64, _c_ptr),
    "merge_sum": (_c_int64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr),
}
"""Argument types of the ``sparse.cpp`` kernels that return an int64."""

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
_disabled = contextvars.ContextVar("hvd_compress_native_disabled", default=False)


def compiler() -> str:
    """The C++ compiler that builds the kernels: ``$HVD_COMPRESS_CXX`` or ``g++``."""
    return os.environ.get("HVD_COMPRESS_CXX", "g++")


def cache_dir() -> Path:
    """Where builds are kept: ``$HVD_COMPRESS_CACHE/native``, ``~/.cache/hvd-compress/native``."""
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
    """Where the build for this source, flags and CPU lives (the C ABI does not depend on
    the compiler, so a build outlives the compiler that made it)."""
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES), " ".join(FLAGS),
                                    platform.machine(), _cpu_identity()]).encode())
    return cache_dir() / f"hvdc-codecs-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels unless already built; return the library's path."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compile next to the target and rename: concurrent builders never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler(), *FLAGS, "-o", tmp, *map(str, SOURCES)],
                                capture_output=True, text=True)
        if result.returncode:
            names = " ".join(src.name for src in SOURCES)
            raise RuntimeError(f"compiling {names} failed:\n{result.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    for name, options in _SIGNATURES.items():
        fn = getattr(lib, f"hvdc_{name}")
        fn.argtypes = [_c_ptr, _c_int64, _c_int64, _c_ptr, ctypes.c_int, *options]
        fn.restype = None
    for name, argtypes in _SPARSE_SIGNATURES.items():
        fn = getattr(lib, f"hvdc_{name}")
        fn.argtypes, fn.restype = list(argtypes), _c_int64
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first use; ``None`` (with a warning) if that
    failed."""
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
    """Whether the kernels are built and not :func:`disabled` in this thread."""
    return not _disabled.get() and library() is not None


def active(t: torch.Tensor) -> bool:
    """Whether ``t`` is coded by these kernels: a CPU tensor, kernels built, not disabled."""
    return t.device.type == "cpu" and not _disabled.get() and library() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block (in this thread), CPU tensors take the torch code, as on a GPU, and
    sparse frames the numpy code."""
    token = _disabled.set(True)
    try:
        yield
    finally:
        _disabled.reset(token)


def seed(generator: torch.Generator) -> int:
    """A 63-bit key for the kernels' random draws, taken from ``generator``."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


def encode(kernel: str, x: torch.Tensor, bucket_size: int, nbytes: int,
           *options: int | float) -> torch.Tensor:
    """Run ``hvdc_<kernel>_encode`` on the float32 CPU tensor ``x``: ``nbytes`` of payload
    (in :func:`~hvd_compress.native.buffers.empty` memory)."""
    x = x.reshape(-1).to(torch.float32).contiguous()
    out = empty(nbytes, torch.uint8)
    fn = getattr(library(), f"hvdc_{kernel}_encode")
    fn(x.data_ptr(), x.numel(), bucket_size, out.data_ptr(), torch.get_num_threads(), *options)
    return out


def decode(kernel: str, payload: torch.Tensor, numel: int, bucket_size: int,
           *options: int) -> torch.Tensor:
    """Run ``hvdc_<kernel>_decode`` on a checked CPU payload: ``numel`` float32 values
    (in :func:`~hvd_compress.native.buffers.empty` memory)."""
    payload = payload.contiguous()
    out = empty(numel, torch.float32)
    fn = getattr(library(), f"hvdc_{kernel}_decode")
    fn(payload.data_ptr(), numel, bucket_size, out.data_ptr(), torch.get_num_threads(),
       *options)
    return out
