"""numpy front end of the parameter server's native round (``sparse.cpp``): the sum of a
round's pushes, mode ``topk``'s re-sparsification with the server residual, and the
aggregate frame, each in one native call with no Python work per pair.

The contract is :mod:`ps_server.rounds`'s, bit for bit: these functions return what its
numpy route returns (``tests/test_ps_native_round.py`` checks both agree). Each returns
``None`` when the native library is unavailable or :func:`hvd_compress.native.disabled`;
the caller then runs that numpy route.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from hvd_compress.native import available, library
from hvd_compress.native.sparse import MERGE_SLACK

NON_FINITE = -2
"""What ``hvdc_round`` and ``hvdc_topk`` return when ``s = residual + sum`` is not finite."""

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype, _bytes_data.argtypes = ctypes.c_void_p, (ctypes.py_object,)

Pairs = tuple[np.ndarray, np.ndarray]

POOL_MIN_BYTES = 1 << 20
"""Arrays smaller than this come from ``np.empty`` (the C heap recycles them)."""
BLOCK_ROUND = 2 << 20
"""Pooled blocks are whole 2 MiB huge pages, so the sizes of near rounds share blocks."""
FREE_BLOCKS = 4
"""Free blocks kept per size; more are unmapped."""
IDLE_LEASES = 256
"""A free block not lent for this many leases is unmapped."""


class _Pool:
    """Memory for the union sums and the pushes' decoded indices, recycled across rounds:
    a fresh large ``np.empty`` is a fresh mapping whose first writes fault every page in
    and zero it, which cost the round as much as the sum itself. A block is lent to one
    array at a time (a union sum's two arrays share one): they are views of one uint8 array
    over the block (numpy makes it the base of every view of them), and the block is free
    again once a weak reference to that array is dead."""

    def __init__(self) -> None:
        # per block size: [mapping, weak reference to the array lent, lease it was lent at]
        self._blocks: dict[int, list[list]] = {}
        self._leases = 0
        self._lock = threading.Lock()

    def lend(self, nbytes: int) -> np.ndarray:
        """``nbytes`` uninitialised bytes (at least :data:`POOL_MIN_BYTES`), a uint8 array
        whose block is lent until it and every view of it are gone."""
        size = -(-nbytes // BLOCK_ROUND) * BLOCK_ROUND
        with self._lock:
            self._leases += 1
            if self._leases % IDLE_LEASES == 0:  # free blocks of sizes no longer asked for
                for key, same in list(self._blocks.items()):
                    same[:] = [b for b in same if b[1]() is not None
                               or self._leases - b[2] < IDLE_LEASES]
                    if not same:
                        del self._blocks[key]
            same = self._blocks.setdefault(size, [])
            free = [b for b in same if b[1]() is None]
            for block in free[FREE_BLOCKS:]:
                same.remove(block)  # unmapped with its last reference
            if free:
                block = free[0]
            else:
                block = [mmap.mmap(-1, size), None, 0]
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    block[0].madvise(mmap.MADV_HUGEPAGE)
                same.append(block)
            lent = np.frombuffer(block[0], np.uint8, nbytes)
            block[1], block[2] = weakref.ref(lent), self._leases
        return lent

    def arrays(self, pairs: int) -> tuple[np.ndarray, np.ndarray]:
        """Uninitialised int64 and float32 arrays of ``pairs`` elements each."""
        if 12 * pairs < POOL_MIN_BYTES:
            return np.empty(pairs, np.int64), np.empty(pairs, np.float32)
        lent = self.lend(12 * pairs)
        return lent[:8 * pairs].view(np.int64), lent[8 * pairs:].view(np.float32)

    def indices(self, count: int) -> np.ndarray:
        """An uninitialised int64 array of ``count`` elements (a push's decoded indices)."""
        if 8 * count < POOL_MIN_BYTES:
            return np.empty(count, np.int64)
        return self.lend(8 * count).view(np.int64)


_POOL = _Pool()
indices_array = _POOL.indices


def _lib() -> ctypes.CDLL | None:
    return library() if available() else None


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
    union_idx, union_val = _POOL.arrays(total + MERGE_SLACK)
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
    status = lib.hvdc_round(len(idx), _ptr(idx_table), _ptr(val_table), _ptr(counts),
                            _ptr(union_idx), _ptr(union_val), ctypes.byref(union_count),
                            None if residual is None else _ptr(residual), numel, k,
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
    status = lib.hvdc_topk(_ptr(residual), numel, _ptr(indices), _ptr(values),
                           indices.size, k, _ptr(out_idx), _ptr(out_val))
    if status == -1:
        raise ValueError("the union sum's indices must be strictly increasing")
    if status == NON_FINITE:
        return _dense_sum(residual, indices, values)
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
