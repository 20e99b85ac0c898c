"""numpy front end of ``sparse.cpp``: varint index coding, the sum of a round's pushes, and
the frames' CRC-32.

Each function returns ``None`` when the native library is unavailable (its
build failed, and :func:`hvd_compress.native.library` has warned) or
:func:`hvd_compress.native.disabled`; the caller then runs its numpy code.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from hvd_compress.native import available, library
from hvd_compress.native.pool import indices_array  # pooled: no page faults per push

MAX_VARINT_BYTES = 5
"""Bytes of the longest varint: a gap below 2**32 (any shard's size) has 5 groups of 7 bits."""
MERGE_SLACK = 8
"""Pairs of room ``hvdc_merge_sum`` needs past the sum of the counts (``kMergeSlack``: it
writes a word's first pairs without a branch per pair, past the last one written)."""


def _lib() -> ctypes.CDLL | None:
    return library() if available() else None


VARINT_ERRORS = {
    -2: "varint longer than 5 bytes: gap too large for any shard",
    -3: "non-canonical varint (redundant trailing zero group)",
}


def _varint_error(status: int, section: np.ndarray, count: int, numel: int) -> str:
    if status == -4:
        return f"an index reaches beyond numel {numel} (out of range)"
    if status == -1:  # ran out of bytes, or bytes remain: count the varints to say which
        held = int(np.count_nonzero((section & 0x80) == 0))
        if held != count:
            return f"index section holds {held} varints, header says {count} pairs"
        return "index section ends inside a varint (truncated or corrupt)"
    return VARINT_ERRORS[status]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def varint_decode_indices(section: np.ndarray, count: int, numel: int,
                          out: np.ndarray | None = None) -> np.ndarray | None:
    """Strictly increasing int64 indices from a delta+varint section, written into ``out``
    (``count`` contiguous int64, e.g. recycled memory) when given; raises ValueError.
    None when the library is unavailable."""
    if count == 0 and section.size == 0:  # a pull's: what the library answers, no lookup
        return np.empty(0, np.int64)
    lib = _lib()
    if lib is None:
        return None
    section = np.ascontiguousarray(section, dtype=np.uint8)
    if out is None:
        out = indices_array(count)
    status = lib.hvdc_varint_decode(_ptr(section), section.size, count, numel, _ptr(out))
    if status:
        raise ValueError(_varint_error(status, section, count, numel))
    return out


def varint_encode_indices(indices: np.ndarray) -> np.ndarray | None:
    """The delta+varint section of strictly increasing non-negative int64 ``indices``."""
    lib = _lib()
    if lib is None:
        return None
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    out = np.empty(MAX_VARINT_BYTES * indices.size, dtype=np.uint8)  # pages touched if used
    written = lib.hvdc_varint_encode(_ptr(indices), indices.size, _ptr(out))
    if written < 0:
        raise ValueError(f"an index gap needs more than {MAX_VARINT_BYTES} varint bytes: "
                         f"indices must be strictly increasing and below "
                         f"2**{7 * MAX_VARINT_BYTES}")
    return out[:written]


def varint_index_nbytes(indices: np.ndarray) -> int | None:
    """Bytes :func:`varint_encode_indices` takes, without encoding."""
    lib = _lib()
    if lib is None:
        return None
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    return int(lib.hvdc_varint_nbytes(_ptr(indices), indices.size))


def merge_sum(pairs: Sequence[tuple[np.ndarray, np.ndarray]]
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """The union of sparse vectors ``(indices, values)`` (strictly increasing int64
    indices) and the sums there, added in list order from 0: increasing int64 indices and
    float32 sums. None if not native."""
    lib = _lib()
    if lib is None:
        return None
    idx = [np.ascontiguousarray(i, dtype=np.int64) for i, _ in pairs]
    val = [np.ascontiguousarray(v, dtype=np.float32) for _, v in pairs]
    counts = np.array([i.size for i in idx], dtype=np.int64)
    total = int(counts.sum())
    indices = np.empty(total + MERGE_SLACK, dtype=np.int64)
    values = np.empty(total + MERGE_SLACK, dtype=np.float32)
    idx_table = np.array([a.ctypes.data for a in idx] or [0], dtype=np.uintp)
    val_table = np.array([a.ctypes.data for a in val] or [0], dtype=np.uintp)
    written = lib.hvdc_merge_sum(len(idx), _ptr(idx_table), _ptr(val_table), _ptr(counts),
                                 _ptr(indices), _ptr(values))
    if written < 0:
        raise ValueError("every list's indices must be increasing")
    return indices[:written], values[:written]


CRC_MIN_BYTES = 4096
"""Buffers below this size go to zlib: a call through ctypes costs more than the CRC of a
few kilobytes."""
_crc_unsupported = False  # set once the library says it was built without PCLMULQDQ


def crc32(data: bytes | bytearray | memoryview, crc: int = 0) -> int | None:
    """zlib's CRC-32 of ``data`` continuing from ``crc`` (the value of ``zlib.crc32(data,
    crc)``), folded with carry-less multiplies (faster than zlib on large buffers; see
    docs/benchmarks.md). None below :data:`CRC_MIN_BYTES`, without the native library, or on
    a CPU build without PCLMULQDQ: use zlib then."""
    global _crc_unsupported
    if _crc_unsupported or memoryview(data).nbytes < CRC_MIN_BYTES:
        return None
    lib = _lib()
    if lib is None:
        return None
    view = np.frombuffer(data, dtype=np.uint8)
    result = lib.hvdc_crc32(crc, view.ctypes.data, view.size)
    if result < 0:
        _crc_unsupported = True
        return None
    return int(result)


# Top-k's candidate selection on a worker (select.cpp) ------------------------------------
def select_magnitude(x: np.ndarray, threshold: float, capacity: int) -> np.ndarray | None:
    """The increasing int64 indices of the entries of the flat float32 ``x`` whose
    magnitude is at least ``threshold`` (``np.flatnonzero(np.abs(x) >= threshold)``, NaN
    entries never passing), in one pass over ``x`` and no array of its size; ``capacity``
    is the count expected (more are found in a second pass). None if not native."""
    lib = _lib()
    if lib is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(max(capacity, 1), dtype=np.int64)
    count = lib.hvdc_select_magnitude(_ptr(x), x.size, float(threshold), _ptr(out), out.size)
    if count > out.size:  # more passed than expected: again, with room for all of them
        out = np.empty(count, dtype=np.int64)
        count = lib.hvdc_select_magnitude(_ptr(x), x.size, float(threshold), _ptr(out),
                                          out.size)
    return out[:count]
