"""numpy front end of ``sparse.cpp``: varint index coding and a shard's accumulator.

Each function returns ``None`` (or ``False``) when the native library is unavailable (its
build failed, and :func:`hvd_compress.native.library` has warned) or
:func:`hvd_compress.native.disabled`; the caller then runs its numpy code.
"""

from __future__ import annotations

import ctypes

import numpy as np

from hvd_compress.native import available, library


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


def varint_decode_indices(section: np.ndarray, count: int, numel: int) -> np.ndarray | None:
    """Strictly increasing int64 indices from a delta+varint section; raises ValueError."""
    lib = _lib()
    if lib is None:
        return None
    section = np.ascontiguousarray(section, dtype=np.uint8)
    out = np.empty(count, dtype=np.int64)
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
    out = np.empty(int(lib.hvdc_varint_nbytes(_ptr(indices), indices.size)), dtype=np.uint8)
    written = lib.hvdc_varint_encode(_ptr(indices), indices.size, _ptr(out))
    assert written == out.size
    return out


def varint_index_nbytes(indices: np.ndarray) -> int | None:
    """Bytes :func:`varint_encode_indices` takes, without encoding."""
    lib = _lib()
    if lib is None:
        return None
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    return int(lib.hvdc_varint_nbytes(_ptr(indices), indices.size))


def touched_words(numel: int) -> int:
    """Length in 64-bit words of the bitmap that marks a shard's touched elements."""
    return (numel + 63) // 64


def scatter_add(acc: np.ndarray, touched: np.ndarray, indices: np.ndarray,
                values: np.ndarray) -> bool:
    """``acc[indices] += values`` and the indices' bits set in ``touched`` (uint64 words,
    bit ``i % 64`` of word ``i // 64``), for unique in-range indices; ``acc`` is float32.
    False if not native."""
    lib = _lib()
    if lib is None:
        return False
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    lib.hvdc_scatter_add(_ptr(acc), _ptr(touched), _ptr(indices), _ptr(values), indices.size)
    return True


def collect(acc: np.ndarray, touched: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The positions whose bits are set (increasing) and their sums; resets both there."""
    lib = _lib()
    if lib is None:
        return None
    count = int(np.bitwise_count(touched).sum())
    indices = np.empty(count, dtype=np.int64)
    values = np.empty(count, dtype=np.float32)
    written = lib.hvdc_collect(_ptr(acc), _ptr(touched), touched.size, _ptr(indices),
                               _ptr(values))
    assert written == count
    return indices, values
