"""Mode topk's native round (``hvdc_topk_bounded`` in hvd_compress/native/sparse.cpp) where
its shortcuts decide: the threshold below which a block of the residual is not read is
the k-th largest |s| of the pairs itself, and the winners are picked by one branch-free
walk over the pairs and the blocks read. Each case is compared bit for bit with the numpy
route (ps_server/rounds.py with the library disabled), residuals included."""

from __future__ import annotations

import numpy as np
import pytest

import hvd_compress.native as native
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server.rounds import close_pushes, new_state

pytestmark = pytest.mark.skipif(not native.available(), reason="native library unavailable")


def push(worker: int, round: int, idx: np.ndarray, val: np.ndarray, numel: int):
    return decode_frame(encode_frame(Kind.PUSH, "w", 0, 1, round, worker, numel,
                                     np.asarray(idx, np.int64), np.asarray(val, np.float32)))


def run_rounds(numel: int, rounds, residual: np.ndarray | None = None):
    """Each route's (aggregate indices, aggregate values, residual) after every round."""
    out = []
    for disabled in (False, True):
        state = new_state("topk", numel, 0, 0.0)
        if residual is not None:
            state.residual = residual.copy()
        seen = []
        for pushes in rounds:
            k = max(f.count for f in pushes)
            if disabled:
                with native.disabled():
                    _, (idx, val) = close_pushes("topk", state, pushes, k)
            else:
                _, (idx, val) = close_pushes("topk", state, pushes, k)
            seen.append((np.array(idx), np.array(val), state.residual.copy()))
        out.append(seen)
    return out


def assert_same(out) -> None:
    for (i1, v1, r1), (i2, v2, r2) in zip(*out):
        assert i1.dtype == i2.dtype and i1.tobytes() == i2.tobytes()
        assert v1.dtype == v2.dtype and v1.tobytes() == v2.tobytes()
        assert r1.tobytes() == r2.tobytes()


def test_residual_entries_at_and_around_the_pairs_kth_magnitude():
    """Untouched entries of the residual one float step below, at and above the pairs'
    k-th largest |s| (all in the magnitude bucket of 2**-7 relative width that the
    threshold used to be rounded down to): those below lose without their blocks being
    read, those at it and above compete with the pairs (k entries reach it)."""
    numel, half = 1 << 16, 1000
    rng = np.random.default_rng(3)
    support = rng.choice(numel, 2 * half, replace=False)
    # |values|: 999 in (1, 2], the k-th (k = half) exactly 1, the rest in [0.25, 1)
    mags = np.concatenate([rng.uniform(1.0, 2.0, half - 1) + 1e-3, [1.0],
                           rng.uniform(0.25, 0.999, half)]).astype(np.float32)
    vals = mags * rng.choice(np.float32([-1, 1]), 2 * half)
    kth = np.float32(1.0)
    residual = np.zeros(numel, np.float32)
    free = np.setdiff1d(np.arange(numel), support)
    spots = rng.choice(free, 300, replace=False)
    near = np.array([np.nextafter(kth, np.float32(0)), kth, np.nextafter(kth, np.float32(2))],
                    np.float32)
    residual[spots] = near[rng.integers(0, 3, spots.size)] * rng.choice([-1, 1], spots.size)
    pushes = []
    for w in range(2):
        part = np.argsort(support[w * half:(w + 1) * half]) + w * half
        pushes.append(push(w, 0, support[part], vals[part], numel))
    out = run_rounds(numel, [pushes], residual)
    assert_same(out)
    top = out[0][0][0]
    assert top.size == half
    assert np.isin(spots[np.abs(residual[spots]) > kth], top).any()  # some untouched win
    below = spots[np.abs(residual[spots]) < kth]
    assert below.size and not np.isin(below, top).any()


@pytest.mark.parametrize("workers", [2, 3])
def test_bench_like_rounds_on_one_residual(workers):
    """Rounds at 1 % density as ``python -m hvd_compress.bench ps`` pushes them (random
    supports, standard normal values): the residual fills up round after round, so that
    later rounds read blocks whose entries reach the pairs' k-th; every aggregate and
    residual is the numpy route's."""
    numel = 1 << 18
    k = numel // 100
    rng = np.random.default_rng(workers)
    rounds = []
    for r in range(12):
        rounds.append([push(w, r, np.sort(rng.choice(numel, k, replace=False)),
                            rng.standard_normal(k).astype(np.float32), numel)
                       for w in range(workers)])
    assert_same(run_rounds(numel, rounds))


def test_fewer_pairs_than_k_reads_every_block():
    """With fewer union pairs than k, every entry is a candidate (the threshold is 0): the
    winners include the lowest untouched zeros, as on the numpy route."""
    numel = 5000
    rng = np.random.default_rng(9)
    residual = (rng.standard_normal(numel) * (rng.random(numel) < 0.02)).astype(np.float32)
    idx = np.sort(rng.choice(numel, 40, replace=False))
    pushes = [push(0, 0, idx, rng.standard_normal(40), numel),
              push(1, 0, np.arange(100), np.zeros(100), numel)]
    out = run_rounds(numel, [pushes], residual)
    assert_same(out)
    assert out[0][0][0].size == 100


def test_ties_across_pairs_and_blocks_read_take_the_lowest_indices():
    """Many entries equal to the k-th magnitude, among the pairs and in blocks read, in
    both signs: the k winners are the larger ones and then the lowest tied indices."""
    numel = 1 << 14
    rng = np.random.default_rng(5)
    residual = np.where(rng.random(numel) < 0.1, rng.choice([-0.5, 0.5], numel), 0.0)
    residual = residual.astype(np.float32)
    idx = np.sort(rng.choice(numel, 600, replace=False))
    val = rng.choice([0.5, -0.5, 0.25, 1.0], idx.size).astype(np.float32)
    val[np.abs(residual[idx]) > 0] = 0.0  # s stays +-0.5 where the residual holds one
    out = run_rounds(numel, [[push(0, 0, idx, val, numel)]], residual)
    assert_same(out)


@pytest.mark.parametrize("sampled", ["large", "small"])
def test_a_misjudged_sampled_guess_changes_no_bit(sampled):
    """The pass over the pairs zeroes those above a guess of the k-th |s| from an evenly
    spaced sample of 2048 pairs. Pairs at the sampled positions larger (or smaller) than
    all others make the guess far too high (or low): every winner it missed is zeroed
    after, every loser it zeroed gets s back, as the numpy route leaves them. A blocked
    residual puts some pairs in blocks read too."""
    numel, n = 1 << 16, 8192
    rng = np.random.default_rng(len(sampled))
    idx = np.sort(rng.choice(numel, n, replace=False))
    sampled_at = np.arange(2048) * n // 2048  # sampled_kth's positions
    val = rng.uniform(1.0, 2.0, n).astype(np.float32)
    val[sampled_at] = 10.0 if sampled == "large" else 0.01
    residual = np.zeros(numel, np.float32)
    residual[rng.choice(numel, 200, replace=False)] = 1.5
    out = run_rounds(numel, [[push(0, 0, idx[::2], val[::2], numel),  # k: half the union
                              push(1, 0, idx[1::2], val[1::2], numel)]], residual)
    assert_same(out)


def test_ties_at_the_sampled_guess_keep_the_lowest_indices():
    """Every pair's |s| equal: the guess is that value, nothing lies above it, and the k
    winners (half the union) are the lowest indices, the rest keep s."""
    numel = 1 << 15
    rng = np.random.default_rng(3)
    idx = np.sort(rng.choice(numel, 5000, replace=False))
    val = rng.choice([0.75, -0.75], idx.size).astype(np.float32)
    out = run_rounds(numel, [[push(0, 0, idx[::2], val[::2], numel),
                              push(1, 0, idx[1::2], val[1::2], numel)]])
    assert_same(out)
