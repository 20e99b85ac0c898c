"""numpy front end of the parameter server's native round (``sparse.cpp``): the sum of a
round's pushes, mode ``topk``'s re-sparsification with the server residual, mode
``gtopk``'s selection from the sum, and the aggregate frame, each in one native call with
no Python work per pair.

The contract is :mod:`ps_server.rounds`'s, bit for bit: these functions return what its
numpy route returns (``tests/test_ps_native_round.py`` checks both agree). Each returns
``None`` when the native library is unavailable or :func:`hvd_compress.native.disabled`;
the caller then runs that numpy route.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from hvd_compress.native import available, library
from hvd_compress.native.pool import ARRAY_MIN_BYTES
from hvd_compress.native.pool import POOL as _POOL
from hvd_compress.native.sparse import MAX_VARINT_BYTES, MERGE_SLACK

NON_FINITE = -2
"""What ``hvdc_round`` and ``hvdc_topk`` return when ``s = residual + sum`` is not finite
(``hvdc_select_largest``: when the sum is not)."""

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype, _bytes_data.argtypes = ctypes.c_void_p, (ctypes.py_object,)

Pairs = tuple[np.ndarray, np.ndarray]


def pooled_arrays(pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """Uninitialised int64 and float32 arrays of ``pairs`` elements each (a union sum's),
    sharing one block of :data:`_POOL` (:mod:`hvd_compress.native.pool`)."""
    if 12 * pairs < ARRAY_MIN_BYTES:
        return np.empty(pairs, np.int64), np.empty(pairs, np.float32)
    lent = _POOL.lend(12 * pairs)
    return lent[:8 * pairs].view(np.int64), lent[8 * pairs:].view(np.float32)


BOUND_BLOCK = 64
"""Residual entries per bound of ``hvdc_topk_bounded`` (``kBoundBlock``)."""

_bounds: dict[int, tuple[weakref.ref, np.ndarray]] = {}
_c_int64, _c_ptr = ctypes.c_int64, ctypes.c_void_p
_BOUNDED_SIGNATURES = {
    "hvdc_topk_bounds": (_c_ptr, _c_int64, _c_ptr),
    "hvdc_topk_bounded": (_c_ptr, _c_int64, _c_ptr, _c_ptr, _c_ptr, _c_int64, _c_int64, _c_ptr,
                          _c_ptr),
    "hvdc_round_bounded": (_c_int64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr,
                           _c_ptr, _c_int64, _c_int64, _c_ptr, _c_ptr),
}
"""Argument types of the kernels with kept bounds (int64 results), set on first use."""


def residual_bounds(lib: ctypes.CDLL, residual: np.ndarray) -> np.ndarray:
    """The bounds ``hvdc_topk_bounded`` keeps for ``residual`` between rounds (for each block of
    :data:`BOUND_BLOCK` entries, at least the largest ``|x|``, as float bits), so that a
    round reads the residual only where the sum lands and in the few blocks that may hold
    a winner: computed by one pass the first time this array is seen, then updated by
    every round. The residual must change only through :func:`close_round` and
    :func:`topk` (the server's routes replace the array otherwise: the numpy route, a
    restore); after changing it in place, call :func:`forget_residual`."""
    key = id(residual)
    held = _bounds.get(key)
    if held is not None and held[0]() is residual:
        return held[1]
    bounds = np.empty(-(-residual.size // BOUND_BLOCK), np.uint32)
    lib.hvdc_topk_bounds(_ptr(residual), residual.size, _ptr(bounds))

    def gone(ref: weakref.ref, key: int = key) -> None:
        if _bounds.get(key, (None,))[0] is ref:
            del _bounds[key]

    _bounds[key] = (weakref.ref(residual, gone), bounds)
    return bounds


def forget_residual(residual: np.ndarray) -> None:
    """Drop the bounds kept for ``residual`` (after changing it other than by a round)."""
    held = _bounds.get(id(residual))
    if held is not None and held[0]() is residual:
        del _bounds[id(residual)]


def _lib() -> ctypes.CDLL | None:
    lib = library() if available() else None
    if lib is not None and lib.hvdc_topk_bounds.restype is not _c_int64:
        for name, argtypes in _BOUNDED_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), _c_int64
    return lib


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _dense_sum(residual: np.ndarray, indices: np.ndarray, values: np.ndarray) -> Pairs:
    """Mode topk's answer when ``s`` is not finite: ``s`` whole (the residual is kept)."""
    total = residual.copy()
    total[indices] += values
    return np.arange(residual.size, dtype=np.int64), total


def close_round(pushes: Sequence[Pairs], numel: int, residual: np.ndarray | None,
                k: int) -> tuple[Pairs, Pairs] | None:
    """The union sum of ``pushes`` (strictly increasing int64 indices, float32 or float16
    values; added in this order from 0) and the round's aggregate: the union sum itself
    without ``residual`` (mode union), else mode topk's ``k`` pairs, with ``residual``
    updated in place (see :mod:`ps_server.rounds`). None if not native."""
    lib = _lib()
    if lib is None:
        return None
    idx = [np.ascontiguousarray(i, dtype=np.int64) for i, _ in pushes]
    val = [np.ascontiguousarray(v, dtype=np.float32) for _, v in pushes]
    total = sum(i.size for i in idx)
    counts = np.array([i.size for i in idx] or [0], dtype=np.int64)
    union_idx, union_val = pooled_arrays(total + MERGE_SLACK)
    idx_table = np.array([a.ctypes.data for a in idx] or [0], dtype=np.uintp)
    val_table = np.array([a.ctypes.data for a in val] or [0], dtype=np.uintp)
    union_count = ctypes.c_int64(0)
    if residual is None:
        agg_idx = agg_val = None
    else:
        if residual.dtype != np.float32 or not residual.flags.c_contiguous or \
                residual.size != numel:
            raise ValueError(f"the residual must be {numel} contiguous float32 values")
        k = max(0, min(k, numel))
        agg_idx = np.empty(k, dtype=np.int64)
        agg_val = np.empty(k, dtype=np.float32)
    status = lib.hvdc_round_bounded(len(idx), _ptr(idx_table), _ptr(val_table), _ptr(counts),
                            _ptr(union_idx), _ptr(union_val), ctypes.byref(union_count),
                            None if residual is None else _ptr(residual),
                            None if residual is None else _ptr(residual_bounds(lib, residual)),
                            numel, k,
                            None if agg_idx is None else _ptr(agg_idx),
                            None if agg_val is None else _ptr(agg_val))
    if status == -1 or union_count.value < 0:
        raise ValueError("every push's indices must be increasing")
    union = union_idx[:union_count.value], union_val[:union_count.value]
    if residual is None:
        return union, union
    if status == NON_FINITE:
        return union, _dense_sum(residual, *union)
    return union, (agg_idx[:status], agg_val[:status])


def topk(residual: np.ndarray, indices: np.ndarray, values: np.ndarray, k: int
         ) -> Pairs | None:
    """Mode topk's aggregate from a round's union sum (what :func:`close_round` does after
    the sum; a restart replays journaled sums through it), updating ``residual`` in place.
    None if not native."""
    lib = _lib()
    if lib is None:
        return None
    numel = residual.size
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    k = max(0, min(k, numel))
    out_idx = np.empty(k, dtype=np.int64)
    out_val = np.empty(k, dtype=np.float32)
    status = lib.hvdc_topk_bounded(_ptr(residual), numel, _ptr(residual_bounds(lib, residual)),
                           _ptr(indices), _ptr(values),
                           indices.size, k, _ptr(out_idx), _ptr(out_val))
    if status == -1:
        raise ValueError("the union sum's indices must be strictly increasing")
    if status == NON_FINITE:
        return _dense_sum(residual, indices, values)
    return out_idx[:status], out_val[:status]


def select_largest(indices: np.ndarray, values: np.ndarray, k: int) -> Pairs | None:
    """Mode gtopk's aggregate from a round's union sum: its ``k`` pairs of largest
    ``|value|`` (of equal ones, the lower indices), in index order; the whole sum when a
    value is not finite. None if not native."""
    lib = _lib()
    if lib is None:
        return None
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    k = max(0, min(k, indices.size))
    out_idx = np.empty(k, dtype=np.int64)
    out_val = np.empty(k, dtype=np.float32)
    status = lib.hvdc_select_largest(_ptr(indices), _ptr(values), indices.size, k,
                                     _ptr(out_idx), _ptr(out_val))
    if status == NON_FINITE:
        return indices, values
    return out_idx[:status], out_val[:status]


def encode_frame(head: bytes, indices: np.ndarray, values: np.ndarray, numel: int,
                 coding: int, size: int) -> bytes | None:
    """A frame of float32 pairs written in one native pass: ``head`` (its header and name,
    packed by :func:`hvd_compress.sparse_wire.encode_frame`'s rules), the sections in
    ``coding``, the CRC; ``size`` is the frame's length. None if not native."""
    lib = _lib()
    if lib is None:
        return None
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = _new_bytes(None, size)  # not shared with anyone until it is written
    written = lib.hvdc_frame_encode(head, len(head), _ptr(indices), _ptr(values),
                                    indices.size, numel, coding, _bytes_data(out))
    if written != size:
        raise RuntimeError(f"native frame encode wrote {written} bytes, expected {size}")
    return out


SECTION_SLACK = 64
"""Bytes ``hvdc_varint_section`` may store past the section it writes."""
_scratch = threading.local()


def varint_section(indices: np.ndarray) -> np.ndarray | None:
    """The delta+varint index section of strictly increasing non-negative int64
    ``indices`` (gaps below 2**35, as any shard's), written once by the frames' encoder
    into memory this thread keeps for the next call (grown to the largest section, never
    shrunk): a view that the next call on this thread overwrites. Its size is the
    section's, so an aggregate frame is sized by writing its section
    (:func:`assemble_frame`), not by a counting pass before the writing. None if not
    native."""
    lib = _lib()
    if lib is None:
        return None
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    room = MAX_VARINT_BYTES * indices.size + SECTION_SLACK
    held = getattr(_scratch, "section", None)
    if held is None or held.size < room:
        held = _scratch.section = np.empty(room + room // 4, np.uint8)
    written = lib.hvdc_varint_section(_ptr(indices), indices.size, _ptr(held))
    return held[:written]


def assemble_frame(head: bytes, section: np.ndarray, values: np.ndarray, size: int
                   ) -> bytes | None:
    """A delta+varint frame of float32 ``values`` from its ``head`` (header and name, as
    :func:`encode_frame` takes) and index ``section`` (:func:`varint_section`'s): the
    bytes :func:`encode_frame` writes for the same pairs, ``size`` of them. None if not
    native."""
    lib = _lib()
    if lib is None:
        return None
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = _new_bytes(None, size)  # not shared with anyone until it is written
    written = lib.hvdc_frame_assemble(head, len(head), _ptr(section), section.size,
                                      _ptr(values), values.size, _bytes_data(out))
    if written != size:
        raise RuntimeError(f"native frame assembly wrote {written} bytes, expected {size}")
    return out
