"""The parameter server's fast paths give the reference results bit for bit: the folded
CRC-32 against zlib, the branch-light merge against a float32 sum in list order, and the
frame encoder (which lets the native varint coder check the index order) against the
checks it replaced."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from hvd_compress import native
from hvd_compress.native import sparse as native_sparse
from hvd_compress.native.loader import march
from hvd_compress.sparse_wire import IndexCoding, Kind, crc32, decode_frame, encode_frame
from tests.harness import cpu_info

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def test_crc32_equals_zlib_at_every_length_offset_and_start_value():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 70_000, dtype=np.uint8).tobytes()
    lengths = [0, 1, 15, 16, 63, 64, 65, 4095, 4096, 4097, 4111, 4160, 65_537]
    for length in lengths:
        for offset in (0, 1, 7, 13):
            view = memoryview(data)[offset:offset + length]
            for start in (0, 1, 0xFFFFFFFF, 0x1234ABCD):
                assert crc32(view, start) == zlib.crc32(view, start), (length, offset, start)
    # The kernel itself answered, unless it was built for a target without PCLMULQDQ
    # (HVD_COMPRESS_MARCH=x86-64 or x86-64-v3), where it declines and zlib answers.
    assert native_sparse.crc32(data) in (zlib.crc32(data), None)
    if "pclmulqdq" in cpu_info()[1] and march() == "native":
        assert native_sparse.crc32(data) == zlib.crc32(data)
    assert native_sparse.crc32(data[:100]) is None  # small buffers are left to zlib


def _reference_sum(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Union of the indices and float32 sums there, added in list order from +0.0."""
    union = np.unique(np.concatenate([i for i, _ in pairs]))
    acc = np.zeros(union.size, np.float32)
    for indices, values in pairs:
        acc[np.searchsorted(union, indices)] += values
    return union, acc


@pytest.mark.parametrize("density", [0.001, 0.02, 0.2, 0.9])
def test_merge_sum_is_the_list_order_float32_sum(density):
    """Sparse blocks (4 pairs taken per word), dense ones (8, then the loop past 8), and
    -0.0 values (a sum starts at +0.0) all give the reference sums bit for bit."""
    rng = np.random.default_rng(int(density * 1000))
    numel = 50_000
    for lists in (1, 2, 3, 8):
        pairs = []
        for _ in range(lists):
            k = int(rng.binomial(numel, density))
            indices = np.sort(rng.choice(numel, k, replace=False)).astype(np.int64)
            values = rng.standard_normal(k).astype(np.float32)
            values[rng.random(k) < 0.05] = -0.0
            pairs.append((indices, values))
        indices, values = native_sparse.merge_sum(pairs)
        expected_indices, expected_values = _reference_sum(pairs)
        assert np.array_equal(indices, expected_indices)
        assert np.array_equal(values.view(np.uint32), expected_values.view(np.uint32))


def _two_lists(rng, case: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two lists of at least 4096 pairs in all (sparse.cpp's merge_two) shaped by ``case``."""
    numel = 1 << 20
    a = np.sort(rng.choice(numel, 6000, replace=False)).astype(np.int64)
    b = np.sort(rng.choice(numel, 5000, replace=False)).astype(np.int64)
    if case == "same":  # every index in both
        b = a.copy()
    elif case == "apart":  # every index of b above a's
        b = a[-1] + 1 + np.arange(5000, dtype=np.int64)
    elif case == "skewed":  # one short list inside a long one
        b = a[rng.choice(a.size, 40, replace=False)]
        b.sort()
    elif case == "shared":  # half of b in a
        b = np.union1d(a[::2], b[:2500]).astype(np.int64)
    pairs = []
    for idx in (a, b):
        values = rng.standard_normal(idx.size).astype(np.float32)
        values[rng.random(idx.size) < 0.05] = -0.0
        values[rng.random(idx.size) < 0.01] = np.nan
        pairs.append((idx, values))
    return pairs


@pytest.mark.parametrize("case", ["random", "same", "apart", "skewed", "shared"])
@pytest.mark.parametrize("swap", [False, True])
def test_two_list_merge_is_the_accumulators_sum(case, swap):
    """Two lists take merge_two (side-by-side branch-free merges); any overlap, either list
    the longer, -0.0 and NaN values give the reference sums and the accumulator's bits (the
    same lists with an empty third one)."""
    rng = np.random.default_rng(["random", "same", "apart", "skewed", "shared"].index(case))
    pairs = _two_lists(rng, case)[::-1 if swap else 1]
    indices, values = native_sparse.merge_sum(pairs)
    expected_indices, expected_values = _reference_sum(pairs)
    assert np.array_equal(indices, expected_indices)
    assert np.array_equal(values.view(np.uint32), expected_values.view(np.uint32))
    empty = (np.zeros(0, np.int64), np.zeros(0, np.float32))
    acc_indices, acc_values = native_sparse.merge_sum([*pairs, empty])
    assert np.array_equal(indices, acc_indices)
    assert np.array_equal(values.view(np.uint32), acc_values.view(np.uint32))


@pytest.mark.parametrize("at", [0, 3000, 5999])
def test_two_list_merge_refuses_a_repeated_or_decreasing_index(at):
    rng = np.random.default_rng(at)
    (a, va), (b, vb) = _two_lists(rng, "random")
    for bad in (a[at - 1], a[at - 1] - 1) if at else (a[1], a[1] + 1):
        broken = a.copy()
        broken[at] = bad
        with pytest.raises(ValueError, match="increasing"):
            native_sparse.merge_sum([(b, vb), (broken, va)])


def test_merge_sum_fills_whole_words_and_the_last_word_of_a_block():
    full = np.arange(8192 * 2, dtype=np.int64)  # every bit of every word of two blocks
    ones = np.ones(full.size, np.float32)
    indices, values = native_sparse.merge_sum([(full, ones), (full[8191:8193], ones[:2])])
    assert np.array_equal(indices, full)
    assert values.sum() == full.size + 2 and values[8191] == values[8192] == 2


@pytest.mark.parametrize("coding", [None, IndexCoding.VARINT, IndexCoding.BITMAP,
                                    IndexCoding.DENSE])
def test_encoder_refuses_unordered_indices_in_every_coding(coding):
    values = np.ones(3, np.float32)
    for bad in ([1, 5, 5], [4, 2, 9], [0, 9, 3]):
        with pytest.raises(ValueError, match="strictly increasing"):
            encode_frame(Kind.PUSH, "t", 0, 1, 0, 0, 10, np.array(bad), values, coding=coding)
    frame = decode_frame(encode_frame(Kind.PUSH, "t", 0, 1, 0, 0, 10, np.array([0, 3, 9]),
                                      values * [1, 2, 3], coding=coding))
    dense = np.zeros(10, np.float32)
    dense[frame.indices] = frame.values  # a dense frame holds the zeros too
    assert dense.tolist() == [1, 0, 0, 2, 0, 0, 0, 0, 0, 3]


def test_large_frames_are_the_same_bytes_with_and_without_the_kernels():
    """Above the CRC threshold and with the varint section made first, the encoder's
    bytes are those of the numpy code."""
    rng = np.random.default_rng(3)
    for numel, k in ((1 << 20, 20_000), (1 << 16, 30_000), (5_000, 5_000)):
        indices = np.sort(rng.choice(numel, k, replace=False))
        values = rng.standard_normal(k).astype(np.float32)
        fast = encode_frame(Kind.AGGREGATE, "t", 1, 2, 7, 0xFFFFFFFF, numel, indices, values)
        with native.disabled():
            slow = encode_frame(Kind.AGGREGATE, "t", 1, 2, 7, 0xFFFFFFFF, numel, indices,
                                values)
        assert fast == slow
        assert decode_frame(fast).indices.tolist() == indices.tolist()
