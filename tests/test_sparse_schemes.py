"""Sparse schemes on in-process ranks: exact sums of differing supports, shared random
indices, DGC's momentum correction and masking."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.schemes.base import Scattered
from hvd_compress.schemes.dgc import MOMENTUM, VELOCITY
from hvd_compress.schemes.topk import largest, sparse_count
from tests.threaded import make_pipelines, on_threads


def test_topk_aggregate_is_the_sum_of_each_ranks_top_entries() -> None:
    scheme = Compression.topk(ratio=0.05)
    pipes = make_pipelines(scheme, 3)
    xs = [torch.randn(20, 10) for _ in range(3)]
    out = on_threads(3, lambda r: pipes[r].reduce({"w": xs[r]})["w"])
    expected = torch.zeros(200)
    tops = []
    for x in xs:
        flat = x.reshape(-1)
        top = flat.abs().topk(10).indices  # k = ceil(0.05 * 200)
        expected[top] += flat[top]
        tops.append(top)
    torch.testing.assert_close(out[0].reshape(-1), expected)
    # What was not sent stays in each rank's residual, exactly.
    for x, top, p in zip(xs, tops, pipes):
        assert torch.equal(p.feedback.get("w").reshape(-1),
                           x.reshape(-1).index_fill(0, top, 0.0))
    # Bytes: each index as the varint of its gap to the previous one, plus a float32 value.
    gaps = torch.diff(tops[0].sort().values, prepend=torch.tensor([-1])) - 1
    assert pipes[0].last_step.payload_bytes == int((gaps >= 128).sum()) + 10 + 4 * 10


def test_topk_fp16_values_keep_their_rounding_in_the_residual() -> None:
    pipes = make_pipelines(Compression.topk(ratio=0.1, values="fp16"), 2)
    xs = [torch.randn(1000) / 3 for _ in range(2)]
    out = on_threads(2, lambda r: pipes[r].reduce({"w": xs[r]})["w"])
    expected = torch.zeros(1000)
    for x, p in zip(xs, pipes):
        top = x.abs().topk(100).indices
        sent = x[top].half().float()
        expected[top] += sent
        residual = x.clone()
        residual[top] -= sent
        assert torch.equal(p.feedback.get("w"), residual)
    assert torch.equal(out[0], expected)
    # 100 values of 2 bytes; gaps below 128 take one byte each.
    assert pipes[0].last_step.payload_bytes < 100 * (4 + 2)


def test_randomk_ranks_draw_the_same_indices_and_all_reduce_values() -> None:
    pipes = make_pipelines(Compression.randomk(ratio=0.1), 2)
    xs = [torch.randn(100), torch.randn(100)]
    out = on_threads(2, lambda r: pipes[r].reduce({"b": xs[r]})["b"])
    support = out[0] != 0
    assert int(support.sum()) == 10
    torch.testing.assert_close(out[0][support], (xs[0] + xs[1])[support])
    assert set(pipes[0].last_step.collective_bytes) == {"values"}
    second = on_threads(2, lambda r: pipes[r].reduce({"b": xs[r]})["b"])
    assert not torch.equal(second[0] != 0, support)  # fresh indices every step


def test_dgc_momentum_correction_and_factor_masking() -> None:
    scheme = Compression.dgc(ratio=0.1, momentum=0.5)
    pipe = make_pipelines(scheme, 1)[0]
    g = torch.arange(1.0, 21.0)  # k = 2: entries 19 and 20 are sent first
    first = pipe.reduce({"w": g})["w"]
    assert torch.equal(first.nonzero().view(-1), torch.tensor([18, 19]))
    state = pipe.scheme_state("w")
    assert state[MOMENTUM][18] == 0 and state[VELOCITY][19] == 0  # masked after sending
    second = pipe.reduce({"w": g})["w"]
    # u = 0.5 u + g; v = v + u: entry 17 (value 18) has v = 18 + (9 + 18) = 45.
    assert second[17] == 45.0


def test_dgc_fp16_values_leave_their_rounding_in_the_velocity() -> None:
    pipe = make_pipelines(Compression.dgc(ratio=0.1, momentum=0.5, values="fp16"), 1)[0]
    g = torch.arange(1.0, 21.0) + 1 / 3
    first = pipe.reduce({"w": g})["w"]
    sent = g[18:].half().float()
    assert torch.equal(first[18:], sent)
    assert torch.equal(pipe.scheme_state("w")[VELOCITY][18:], g[18:] - sent)


def test_dgc_warmup_density_schedule_matches_the_paper() -> None:
    scheme = Compression.dgc(ratio=0.001, warmup_steps=400)
    densities = [scheme.density(step) for step in (0, 100, 200, 300, 400)]
    # The paper: 75%, 93.75%, 98.4375%, 99.6%, then 99.9% sparsity.
    assert densities == pytest.approx([0.25, 0.0625, 0.015625, 0.004, 0.001], rel=0.02)


def test_dgc_sampled_threshold_finds_most_of_the_true_top_k() -> None:
    scheme = Compression.dgc(ratio=0.01, sample_ratio=0.01)
    pipe = make_pipelines(scheme, 1)[0]
    g = torch.randn(200_000, generator=torch.Generator().manual_seed(3))
    out = pipe.reduce({"w": g})["w"]
    sent = set(out.nonzero().view(-1).tolist())
    k = sparse_count(0.01, g.numel())
    true_top = set(g.abs().topk(k).indices.tolist())
    assert len(sent) <= k
    assert len(sent & true_top) >= 0.95 * k


@pytest.mark.parametrize("kind", ["normal", "heavy", "blocks", "spike"])
def test_largest_selects_exactly_what_torch_topk_selects(kind: str) -> None:
    """The sampled threshold only narrows the candidates; the answer is the exact top-k."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1 << 20, 1000
    if kind == "normal":
        magnitude = torch.randn(n, generator=gen).abs()
    elif kind == "heavy":  # a few very large entries among many small ones
        magnitude = torch.rand(n, generator=gen).pow(40)
    elif kind == "blocks":  # the largest entries all in one region, every value distinct
        magnitude = torch.arange(n, dtype=torch.float32)
    else:  # exactly k entries stand far above the rest
        magnitude = torch.rand(n, generator=gen)
        magnitude[torch.randperm(n, generator=gen)[:k]] += 1e6
    got = largest(magnitude, k, torch.Generator().manual_seed(5))
    want = magnitude.topk(k).indices
    assert got.numel() == k
    assert set(got.tolist()) == set(want.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(9000, 9), (262144, 263), (1 << 20, 1 << 14)])
def test_largest_keeps_the_k_largest_magnitudes_of_every_dtype_and_size(
        dtype: torch.dtype, n: int, k: int) -> None:
    """numpy's comparison (float32, float16) and torch's (bfloat16) give the exact top-k;
    with ties in the low-precision dtypes, the same multiset of magnitudes."""
    gen = torch.Generator().manual_seed(n + k)
    for seed in range(5):
        magnitude = torch.randn(n, generator=gen).abs().to(dtype)
        got = largest(magnitude, k, torch.Generator().manual_seed(seed))
        assert got.numel() == k == got.unique().numel()
        assert torch.equal(magnitude[got].sort().values,
                           magnitude.topk(k).values.sort().values)


def test_scattered_contribution_subtracts_and_writes_like_its_dense_form() -> None:
    gen = torch.Generator().manual_seed(2)
    indices = torch.randperm(60, generator=gen)[:7]
    value = Scattered(indices, torch.randn(7, generator=gen), torch.Size((6, 10)))
    dense = value.materialize()
    assert torch.count_nonzero(dense) == 7
    torch.testing.assert_close(value.total(), dense.sum())
    x = torch.randn(6, 10, generator=gen)
    assert torch.equal(value.subtract_from(x.clone()), x - dense)
    torch.testing.assert_close(value.write(torch.full((6, 10), 9.0), 0.25), 0.25 * dense)
