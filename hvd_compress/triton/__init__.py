"""Triton kernels of the codecs on CUDA tensors, and the choice between them and torch ops.

The schemes code a CUDA tensor with these kernels when Triton imports and the kernel
compiles; otherwise with their torch code, after ONE :class:`TritonFallbackWarning` per
process saying why (Triton not installed, or the compiler's error). CPU tensors never come
here: they take the native C++ kernels (:mod:`hvd_compress.native`) or the torch code.

Every kernel writes what the CPU codec writes for the same input and the same random draws,
bit for bit (``tests/test_triton_kernels.py`` checks it under Triton's interpreter,
``TRITON_INTERPRET=1``, on CPU tensors, and on CUDA where there is one):

* :mod:`~hvd_compress.triton.packed`: 1-bit, QSGD and TernGrad encode and decode, each
  encode optionally with error feedback fused (``x = g + e`` read once, the new residual
  ``x - decode(encode(x))`` written in the packing pass). QSGD and TernGrad draw the
  native kernels' counter-based hash of (seed, bucket, element), keyed from a seed tensor
  on the device (no host synchronisation);
* :mod:`~hvd_compress.triton.cast`: float16/bfloat16 casts, fused with the residual;
* :mod:`~hvd_compress.triton.sparse`: top-k's sampled threshold and the compaction of the
  entries past it, random-k's gather (and scaling), and the deterministic segment sum of
  the all-gather route (one pass per rank, in rank order, no atomics).

See docs/gpu.md for what runs where and for the GPU figures.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TypeVar

import torch

__all__ = ["TritonFallbackWarning", "active", "available", "call", "disabled", "kernels",
           "reason"]

KERNEL_MODULES = ("packed", "cast", "sparse")
"""The kernel modules (``hvd_compress.triton.<name>``), imported on first use."""

DISABLE_ENV = "HVD_COMPRESS_NO_TRITON"
"""Set to 1 to send CUDA tensors to the torch code without trying Triton (no warning)."""


class TritonFallbackWarning(RuntimeWarning):
    """CUDA tensors take the torch code instead of the Triton kernels; the message says
    why. Issued once per process."""


_lock = threading.Lock()
_state: dict[str, object] = {"reason": None, "checked": False, "warned": False}
_disabled = threading.local()
_R = TypeVar("_R")


def reason() -> str | None:
    """Why the Triton kernels are not used (``None`` if they are): Triton missing, or a
    kernel that failed to compile (the first such error)."""
    if not _state["checked"]:
        with _lock:
            if not _state["checked"]:
                try:
                    import triton
                    import triton.language  # noqa: F401
                except Exception as err:  # ImportError, or a broken install
                    _state["reason"] = f"triton not installed or not importable ({err})"
                _state["checked"] = True
    return _state["reason"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the Triton route is open (Triton imports and no kernel failed to build)."""
    return reason() is None


def _fall_back(why: str) -> None:
    with _lock:
        if _state["reason"] is None:
            _state["reason"] = why
        if _state["warned"]:
            return
        _state["warned"] = True
    warnings.warn(f"hvd_compress: CUDA tensors are coded by the torch code, not the Triton "
                  f"kernels: {why} (see docs/gpu.md)", TritonFallbackWarning, stacklevel=3)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block (on this thread) CUDA tensors take the torch code."""
    before = getattr(_disabled, "on", False)
    _disabled.on = True
    try:
        yield
    finally:
        _disabled.on = before


def active(t: torch.Tensor | torch.device) -> bool:
    """Whether ``t`` (a tensor, or a device) is coded by the Triton kernels: on CUDA, the
    route not disabled (:func:`disabled`, :data:`DISABLE_ENV`), and Triton there; warns
    once (see the module docstring) when CUDA finds Triton missing."""
    device = t if isinstance(t, torch.device) else t.device
    if device.type != "cuda" or getattr(_disabled, "on", False) \
            or os.environ.get(DISABLE_ENV) == "1":
        return False
    why = reason()
    if why is not None:
        _fall_back(why)
        return False
    return True


def kernels(name: str) -> ModuleType:
    """The kernel module ``hvd_compress.triton.<name>`` (one of :data:`KERNEL_MODULES`),
    imported on first use. Triton decides at import whether its kernels are compiled or
    interpreted (``TRITON_INTERPRET``, read when ``triton.language`` is first imported)."""
    if name not in KERNEL_MODULES:
        raise ValueError(f"no Triton kernel module {name!r}; one of {KERNEL_MODULES}")
    return importlib.import_module(f"{__name__}.{name}")


def call(fn: Callable[..., _R] | str, *args: object, **kwargs: object) -> _R | None:
    """``fn(*args, **kwargs)``, ``fn`` a callable or ``"module.function"`` of
    :data:`KERNEL_MODULES` (imported here), or ``None`` after the one warning if it fails
    to import, compile or launch: the caller then runs its torch code, as does every later
    call (the route closes)."""
    try:
        if isinstance(fn, str):
            module, _, name = fn.partition(".")
            fn = getattr(kernels(module), name)
        return fn(*args, **kwargs)
    except Exception as err:  # a compiler or launch error: fall back for good
        first = str(err).splitlines()[0] if str(err) else ""
        _fall_back(f"the Triton kernel {getattr(fn, '__qualname__', fn)} failed "
                   f"({type(err).__name__}: {first})")
        return None


# --- The schemes' entry points: each returns None when the caller should run its torch
# code instead (the route closed, after the one warning).

def seed_tensor(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A one-element int64 tensor on ``device`` holding a 63-bit key drawn from
    ``generator`` (as :func:`hvd_compress.native.seed` draws one), without a host sync
    when the generator is the device's."""
    if generator.device == device or (generator.device.type == device.type == "cuda"
                                      and generator.device.index is None):
        return torch.empty(1, dtype=torch.int64, device=device).random_(generator=generator)
    return torch.empty(1, dtype=torch.int64).random_(generator=generator).to(device)


def encode_packed(codec: str, x: torch.Tensor, bucket_size: int,
                  generator: torch.Generator | None = None, **options: object
                  ) -> torch.Tensor | None:
    """``codec``'s payload of the CUDA tensor ``x`` by
    :func:`hvd_compress.triton.packed.encode` (draws keyed from ``generator`` for QSGD
    and TernGrad), or ``None`` (see :func:`call`)."""
    def run() -> torch.Tensor:
        seed = seed_tensor(generator, x.device) if generator is not None else None
        return kernels("packed").encode(codec, x, bucket_size, seed=seed, **options)[0]
    run.__qualname__ = f"packed.encode({codec})"
    return call(run)


def decode_packed(codec: str, payload: torch.Tensor, numel: int, bucket_size: int,
                  bits: int = 1) -> torch.Tensor | None:
    """:func:`hvd_compress.triton.packed.decode` of a checked payload, or ``None``."""
    return call("packed.decode", codec, payload, numel, bucket_size, bits)


def encode_half(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The float16/bfloat16 payload bytes of ``x`` (:func:`hvd_compress.triton.cast.encode`),
    or ``None``."""
    out = call("cast.encode", x, dtype)
    return None if out is None else out[0]
