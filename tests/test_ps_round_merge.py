"""The native sum of two pushes (``merge_two`` in hvd_compress/native/sparse.cpp) checks the
lists' order on its output as it writes it, not by a pass over each list first: a list
that does not increase strictly anywhere (at either end, at the cut between its two
merges, by a repeated index) is refused, and increasing lists give the numpy sum."""

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
