"""The native sum of two pushes (``merge_wide``, 8 pairs at a time, on CPUs with AVX-512,
else ``merge_two``, in hvd_compress/native/sparse.cpp): a list that does not increase
strictly anywhere (at either end, at the cut between its runs, by a repeated index) is
refused, and increasing lists give the numpy sum bit for bit, however their indices
interleave, wherever their sizes leave a block of 8 part full, and whatever the values
(signed zeros, infinities, NaN)."""

from __future__ import annotations

import numpy as np
import pytest

import hvd_compress.native as native
from hvd_compress.native import round as native_round
from hvd_compress.native.sparse import merge_sum

pytestmark = pytest.mark.skipif(not native.available(), reason="native library unavailable")

NUMEL = 1 << 20


def lists(seed: int, count: int = 6000):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        idx = np.sort(rng.choice(NUMEL, count, replace=False)).astype(np.int64)
        out.append((idx, rng.standard_normal(count).astype(np.float32)))
    return out


def numpy_sum(pairs):
    acc = np.zeros(NUMEL, np.float32)
    for idx, val in pairs:
        acc[idx] += val
    union = np.unique(np.concatenate([idx for idx, _ in pairs]))
    return union, acc[union]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_increasing_lists_give_the_numpy_sum(seed):
    pairs = lists(seed)
    idx = np.unique(np.concatenate([pairs[0][0][::3], pairs[1][0]]))  # a third shared
    pairs[1] = (idx, np.random.default_rng(seed).standard_normal(idx.size).astype(np.float32))
    want = numpy_sum(pairs)
    for got in (merge_sum(pairs), native_round.close_round(pairs, NUMEL, None, 0)[0]):
        assert got[0].tobytes() == want[0].tobytes()
        assert got[1].tobytes() == want[1].tobytes()


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("where", ["first", "middle", "cut", "last", "repeat"])
def test_a_list_out_of_order_anywhere_is_refused(which, where):
    pairs = lists(7)
    idx = pairs[which][0].copy()
    longer = pairs[0][0] if pairs[0][0].size >= pairs[1][0].size else pairs[1][0]
    cut = longer[longer.size // 2]  # where merge_two splits the range between its merges
    at = {"first": 0, "middle": idx.size // 3, "last": idx.size - 2, "repeat": idx.size // 5,
          "cut": int(np.searchsorted(idx, cut)) - 1}[where]
    if where == "repeat":
        idx[at + 1] = idx[at]
    else:
        idx[at], idx[at + 1] = idx[at + 1], idx[at]
    pairs[which] = (idx, pairs[which][1])
    with pytest.raises(ValueError, match="increasing"):
        merge_sum(pairs)
    with pytest.raises(ValueError, match="increasing"):
        native_round.close_round(pairs, NUMEL, None, 0)
    residual = np.zeros(NUMEL, np.float32)
    with pytest.raises(ValueError, match="increasing"):
        native_round.close_round(pairs, NUMEL, residual, 100)
    assert not residual.any()  # refused before the residual is touched


def pair_list(idx, rng):
    idx = np.asarray(idx, dtype=np.int64)
    return idx, rng.standard_normal(idx.size).astype(np.float32)


def check_sum(pairs):
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, 3e38 + 3e38
        want = numpy_sum(pairs)
    got = merge_sum(pairs)
    assert got[0].tobytes() == want[0].tobytes()
    assert got[1].tobytes() == want[1].tobytes()


@pytest.mark.parametrize("sizes", [(4096, 0), (0, 4100), (1, 4095), (4095, 1), (7, 4100),
                                   (4100, 9), (4103, 4105), (2049, 2047), (8, 4088)])
@pytest.mark.parametrize("layout", ["random", "a-first", "b-first", "blocks", "shared"])
def test_sizes_and_interleavings_give_the_numpy_sum(sizes, layout):
    """Lists of these sizes (at least 4096 pairs in all: the two-list merge), drawn at
    random, one entirely below the other, alternating in stretches of 8 to 24, or the
    shorter one's indices all in the longer one."""
    rng = np.random.default_rng(sum(sizes))
    na, nb = sizes
    if layout == "random":
        a = np.sort(rng.choice(NUMEL, na, replace=False))
        b = np.sort(rng.choice(NUMEL, nb, replace=False))
    elif layout in ("a-first", "b-first"):
        low = np.arange(0, na if layout == "a-first" else nb)
        high = np.arange(low.size + 5, low.size + 5 + (nb if layout == "a-first" else na))
        a, b = (low, high) if layout == "a-first" else (high, low)
    elif layout == "blocks":
        stretches = rng.integers(8, 25, 2 * (na + nb) // 8 + 2)
        owners = np.repeat(np.arange(stretches.size) % 2, stretches)
        a, b = np.flatnonzero(owners == 0)[:na], np.flatnonzero(owners == 1)[:nb]
    else:
        longer = np.sort(rng.choice(NUMEL, max(sizes), replace=False))
        shorter = np.sort(rng.choice(longer, min(sizes), replace=False))
        a, b = (longer, shorter) if na >= nb else (shorter, longer)
    check_sum([pair_list(a, rng), pair_list(b, rng)])


def test_signed_zeros_infinities_and_nan_sum_as_numpy_adds_them():
    rng = np.random.default_rng(3)
    idx = np.sort(rng.choice(NUMEL, 6000, replace=False))
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 3e38], np.float32)
    pairs = [(idx, rng.choice(special, idx.size)),
             (idx[::2], rng.choice(special, idx[::2].size))]
    check_sum(pairs)


def test_indices_beyond_the_wide_merges_range_give_the_numpy_sum():
    """Indices past 2**62 (no room for the list's bit in a key) take the one-pair-at-a-time
    merge: the same sums."""
    rng = np.random.default_rng(4)
    base = np.int64(1) << np.int64(62)
    a = base + np.sort(rng.choice(1 << 20, 5000, replace=False)).astype(np.int64)
    b = base + np.sort(rng.choice(1 << 20, 5000, replace=False)).astype(np.int64)
    pairs = [pair_list(a, rng), pair_list(b, rng)]
    union = np.unique(np.concatenate([a, b]))
    sums = {}
    for idx, val in pairs:
        for i, v in zip(idx.tolist(), val.tolist()):
            sums[i] = np.float32(np.float32(sums.get(i, np.float32(0.0))) + np.float32(v))
    got = merge_sum(pairs)
    assert got[0].tolist() == union.tolist()
    assert got[1].tobytes() == np.array([sums[i] for i in union.tolist()], np.float32).tobytes()
