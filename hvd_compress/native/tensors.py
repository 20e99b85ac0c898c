"""The torch side of the codec kernels: which tensors they code, and encode/decode calls.

Each encode or decode of a CPU tensor is one fused pass over the data in C++ (OpenMP, with
torch's intra-op thread count), writing the layouts of :mod:`hvd_compress.wire` bit for
bit; tensors on other devices take the schemes' torch code. The call goes through
:mod:`ctypes` with the tensors' data pointers; ctypes releases the GIL for it, so ranks run
on threads encode in parallel. Payloads and decoded values are written into
:func:`~hvd_compress.native.buffers.empty` memory (recycled for large ones).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from hvd_compress.native.buffers import empty
from hvd_compress.native.loader import is_disabled, library

STEP_POOL_MIN_BYTES = 512 << 10
"""The fused error-feedback path's float32 buffers of a step (the reducing rank's sum and
residual, the aggregate) come from the pool from this size on, below
:data:`~hvd_compress.native.buffers.POOL_MIN_BYTES`: a fresh 1 MB ``torch.empty`` written
once cost about 240 us of page faults against 70 us from the pool (one thread, measured on
a loaded machine), while up to 256 kB the C heap recycles its memory."""


def active(t: torch.Tensor) -> bool:
    """Whether ``t`` is coded by these kernels: a CPU tensor, kernels built, not disabled."""
    return t.is_cpu and not is_disabled() and library() is not None


def seed(generator: torch.Generator) -> int:
    """A 63-bit key for the kernels' random draws, taken from ``generator``."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


def encode(kernel: str, x: torch.Tensor, bucket_size: int, nbytes: int,
           *options: int | float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``hvdc_<kernel>_encode`` on the float32 CPU tensor ``x``: ``nbytes`` of payload,
    written into ``out`` (a contiguous uint8 tensor of ``nbytes``) if given, else into
    :func:`~hvd_compress.native.buffers.empty` memory."""
    x = x.reshape(-1).to(torch.float32).contiguous()
    out = empty(nbytes, torch.uint8) if out is None else out
    fn = getattr(library(), f"hvdc_{kernel}_encode")
    fn(x.data_ptr(), x.numel(), bucket_size, out.data_ptr(), torch.get_num_threads(), *options)
    return out


def decode(kernel: str, payload: torch.Tensor, numel: int, bucket_size: int,
           *options: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``hvdc_<kernel>_decode`` on a checked CPU payload: ``numel`` float32 values,
    written into ``out`` (a contiguous float32 tensor of ``numel``) if given, else into
    :func:`~hvd_compress.native.buffers.empty` memory."""
    payload = payload.contiguous()
    out = empty(numel, torch.float32) if out is None else out
    fn = getattr(library(), f"hvdc_{kernel}_decode")
    fn(payload.data_ptr(), numel, bucket_size, out.data_ptr(), torch.get_num_threads(),
       *options)
    return out


def scaled(kernel: str, payload: torch.Tensor, numel: int, bucket_size: int, factor: float,
           *options: int, out: torch.Tensor) -> torch.Tensor:
    """Run ``hvdc_<kernel>_scaled``: ``out = decode(payload) * factor`` (``factor`` rounded
    to float32, as torch's ``mul_`` of a float32 tensor by a Python float rounds it) in one
    pass, bit for bit :func:`decode` then ``out.mul_(factor)``; ``out`` a contiguous
    float32 CPU tensor of ``numel``. Returns ``out``."""
    payload = payload.contiguous()
    fn = getattr(library(), f"hvdc_{kernel}_scaled")
    fn(payload.data_ptr(), numel, bucket_size, out.data_ptr(), torch.get_num_threads(),
       factor, *options)
    return out


def subtract(kernel: str, payload: torch.Tensor, x: torch.Tensor, bucket_size: int,
             *options: int) -> torch.Tensor:
    """Run ``hvdc_<kernel>_subtract``: ``x -= decode(payload)`` in place, for a contiguous
    float32 CPU tensor ``x`` and a checked payload of ``x.numel()`` elements, without
    writing the decoded values anywhere. Returns ``x``."""
    payload = payload.contiguous()
    fn = getattr(library(), f"hvdc_{kernel}_subtract")
    fn(payload.data_ptr(), x.numel(), bucket_size, x.data_ptr(), torch.get_num_threads(),
       *options)
    return x


def total(kernel: str, payload: torch.Tensor, numel: int, bucket_size: int,
          *options: int) -> float:
    """Run ``hvdc_<kernel>_total``: the sum of the ``numel`` values a checked CPU payload
    decodes to, accumulated in float64 from the payload alone (no decoded tensor): NaN or
    infinite when a decoded value is (a sum of finite values is finite). Equal to the
    decoded values' exact sum within float64 rounding, not to torch's float32 sum."""
    payload = payload.contiguous()
    out = ctypes.c_double()
    fn = getattr(library(), f"hvdc_{kernel}_total")
    fn(payload.data_ptr(), numel, bucket_size, ctypes.addressof(out), torch.get_num_threads(),
       *options)
    return out.value


def reduce(kernel: str, payloads: Sequence[torch.Tensor], numel: int, bucket_size: int,
           residual: torch.Tensor | None, encoded: torch.Tensor | None,
           *options: int | float) -> torch.Tensor:
    """Run ``hvdc_<kernel>_reduce``: the float32 sum of the decodings of ``payloads``
    (checked CPU payloads of ``numel`` elements each), added in the order given, then
    ``residual`` (a contiguous float32 tensor of ``numel``) if given: bit for bit
    ``decode(p0) + decode(p1) + ... + residual`` in float32, into
    :func:`~hvd_compress.native.buffers.empty` memory. With ``encoded`` (contiguous uint8,
    the payload's size), the same pass encodes the sum into it with encode's ``options``
    (drawn as encode draws them) and returns ``sum - decode(encoded)`` instead, bit for bit
    what decoding and subtracting give. The result is pooled from
    :data:`STEP_POOL_MIN_BYTES` on."""
    payloads = [p.contiguous() for p in payloads]  # alive until the kernel returns
    pointers = (ctypes.c_void_p * len(payloads))(*(p.data_ptr() for p in payloads))
    out = empty(numel, torch.float32, pool_min_bytes=STEP_POOL_MIN_BYTES)
    fn = getattr(library(), f"hvdc_{kernel}_reduce")
    fn(ctypes.addressof(pointers), numel, bucket_size, out.data_ptr(), torch.get_num_threads(),
       len(payloads), None if residual is None else residual.data_ptr(),
       None if encoded is None else encoded.data_ptr(), *options)
    return out


LOWRANK_MAX_RANK = 256
"""The largest rank the ``lowrank.cpp`` kernels take (``kMaxRank`` there)."""


def _lowrank_ready(out: torch.Tensor, *factors: torch.Tensor) -> bool:
    """Whether the ``lowrank.cpp`` kernels take these tensors: float32 on the CPU with the
    kernels :func:`active`."""
    return active(out) and all(t.dtype == torch.float32 and t.is_cpu
                               for t in (out, *factors))


def lowrank_apply(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float,
                  subtract: bool) -> bool:
    """``out = scale * left @ right.T`` (or, ``subtract``, ``out -= left @ right.T``) by
    ``hvdc_lowrank_apply`` (``lowrank.cpp``: each entry's ``r`` products summed in order,
    without fused multiply-adds, the same bits on every thread count), ``out`` viewed as
    ``n x m``. Runs only for a contiguous float32 CPU ``out`` and float32 factors of rank at
    most :data:`LOWRANK_MAX_RANK` with the kernels :func:`active`; returns whether it ran
    (the caller then takes torch's ``addmm``)."""
    n, r = left.shape
    m = right.shape[0]
    if not (_lowrank_ready(out, left, right) and out.is_contiguous()
            and out.numel() == n * m and 0 < r <= LOWRANK_MAX_RANK):
        return False
    right_t = right.t().contiguous()  # r x m; a no-op for PowerSGD's kept Q
    library().hvdc_lowrank_apply(left.data_ptr(), n, r, left.stride(0), left.stride(1),
                                 right_t.data_ptr(), m, out.data_ptr(), scale, int(subtract),
                                 torch.get_num_threads())
    return True


def lowrank_right(out: torch.Tensor, matrix: torch.Tensor, right: torch.Tensor) -> bool:
    """``out = matrix @ right`` (``n x m`` by ``m x r``; ``out`` an ``n x r`` view with any
    strides, such as the transpose of an ``r x n`` buffer) by ``hvdc_lowrank_right``
    (``lowrank.cpp``: 16 lanes a row, added in a stated order), for float32 CPU tensors
    whose ``matrix`` rows are contiguous. Returns whether it ran."""
    n, m = matrix.shape
    r = right.shape[1]
    if not (_lowrank_ready(out, matrix, right) and matrix.stride(1) == 1
            and tuple(out.shape) == (n, r) and 0 < r <= LOWRANK_MAX_RANK):
        return False
    right_t = right.t().contiguous()  # r x m
    library().hvdc_lowrank_right(matrix.data_ptr(), matrix.stride(0), n, m,
                                 right_t.data_ptr(), r, out.data_ptr(), out.stride(0),
                                 out.stride(1), torch.get_num_threads())
    return True


def lowrank_left(out: torch.Tensor, basis: torch.Tensor, matrix: torch.Tensor) -> bool:
    """``out = basis.T @ matrix`` (``n x r`` by ``n x m``; ``out`` a contiguous ``r x m``
    tensor) by ``hvdc_lowrank_left`` (``lowrank.cpp``: each sum over the rows in order), for
    float32 CPU tensors whose ``matrix`` rows are contiguous. Returns whether it ran."""
    n, m = matrix.shape
    r = basis.shape[1]
    if not (_lowrank_ready(out, basis, matrix) and matrix.stride(1) == 1
            and out.is_contiguous() and tuple(out.shape) == (r, m) and basis.shape[0] == n
            and n > 0 and 0 < r <= LOWRANK_MAX_RANK):
        return False
    library().hvdc_lowrank_left(basis.data_ptr(), n, r, basis.stride(0), basis.stride(1),
                                matrix.data_ptr(), matrix.stride(0), m, out.data_ptr(),
                                torch.get_num_threads())
    return True
