"""Top-k's one-pass candidate selection (select.cpp, ``largest_of``): the same indices as
the selection over the magnitudes it replaces, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_compress import native
from hvd_compress.native import sparse as native_sparse
from hvd_compress.schemes.topk import largest, largest_of, sparse_count

needs_native = pytest.mark.skipif(not native.available(), reason="native library unavailable")


@needs_native
@pytest.mark.parametrize("capacity", [0, 1, 100, 1 << 20])
def test_select_magnitude_is_flatnonzero_of_the_magnitudes(capacity: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in (0, 1, 63, 64, 65, 1000, 100_003):
        x = torch.randn(n, generator=gen)
        if n > 10:
            x[3], x[7], x[n - 1] = float("nan"), -0.0, float("-inf")
        for threshold in (0.0, 1.5, 3.0, float("inf")):
            expected = np.flatnonzero(np.abs(x.numpy()) >= np.float32(threshold))
            got = native_sparse.select_magnitude(x.numpy(), threshold, capacity)
            assert got is not None and got.dtype == np.int64
            np.testing.assert_array_equal(got, expected)
    # A NaN threshold lets nothing pass (largest_of then runs the full top-k).
    got = native_sparse.select_magnitude(np.ones(200, np.float32), float("nan"), 10)
    assert got is not None and got.size == 0


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "nan", "many_nan", "blocks",
                                  "small"])
def test_largest_of_selects_what_largest_of_the_magnitudes_selects(kind: str) -> None:
    gen = torch.Generator().manual_seed(2)
    for trial in range(12):
        n = 5000 if kind == "small" else 20_000 + 37_001 * trial
        x = torch.randn(n, generator=gen)
        if kind == "ties":
            x = torch.round(x * 2) / 2
        elif kind == "zeros":
            x[:] = 0
        elif kind == "nan":
            x[torch.randint(0, n, (4,), generator=gen)] = float("nan")
        elif kind == "many_nan":  # the sample holds NaNs: the threshold is NaN
            x[::50] = float("nan")
        elif kind == "blocks":
            x[n // 3:n // 3 + 200] *= 100
        for ratio in (0.001, 0.01, 0.05):
            k = sparse_count(ratio, n)
            expected = largest(x.abs(), k, torch.Generator().manual_seed(trial))
            got = largest_of(x, k, torch.Generator().manual_seed(trial))
            assert torch.equal(got, expected), (kind, trial, ratio)


def test_largest_of_without_the_library_is_largest_of_the_magnitudes() -> None:
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    expected = largest(x.abs(), 300, torch.Generator().manual_seed(0))
    with native.disabled():
        got = largest_of(x, 300, torch.Generator().manual_seed(0))
    assert torch.equal(got, expected)
