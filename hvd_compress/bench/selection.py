"""Cost of choosing DGC's entries: the sampled threshold against an exact ``torch.topk``.

For each size and density, both select ``k = ceil(density * n)`` entries of large
magnitude from the same normally distributed vector: ``torch.topk(|v|, k)`` (exact), and
:meth:`hvd_compress.schemes.dgc.DGC.select` (magnitudes of a random 1% sample give a
threshold aimed at ``1.5 k`` candidates; the exact top-``k`` of those is kept). Timings
alternate between the two and take the median of ``repeat`` runs after a warm-up; recall is
the fraction of the true top-``k`` the threshold selection found.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from hvd_compress.bench.report import Column, Row, Target, field
from hvd_compress.schemes.base import ExchangeContext
from hvd_compress.schemes.dgc import DGC
from hvd_compress.schemes.topk import sparse_count

DENSITIES = (0.001, 0.01)

COLUMNS = (
    Column("elements", field("numel", "{:,}")),
    Column("density", field("density", "{:g}")),
    Column("k", field("k", "{:,}")),
    Column("torch.topk ms", field("topk_ms", "{:.2f}")),
    Column("threshold ms", field("threshold_ms", "{:.2f}")),
    Column("speed-up", field("speedup", "{:.2f}x")),
    Column("recall", field("recall", "{:.4f}")),
)
TARGETS = (Target({"benchmark": "selection"}, "recall", ">=", 0.95),)


def title(repeat: int) -> str:
    return (f"Top-k selection for DGC: sampled threshold vs exact torch.topk (median of "
            f"{repeat}, {torch.get_num_threads()} torch threads)")


def _time_ms(fn: Callable[[], torch.Tensor], times: list[float]) -> None:
    start = time.perf_counter()
    fn()
    times.append(1e3 * (time.perf_counter() - start))


def measure(numel: int, density: float, repeat: int) -> Row:
    gen = torch.Generator().manual_seed(numel)
    v = torch.randn(numel, generator=gen)
    k = sparse_count(density, numel)
    scheme = DGC(ratio=density)
    ctx = ExchangeContext("bench.selection", 0, 1, 0)

    def exact() -> torch.Tensor:
        return v.abs().topk(k, sorted=False).indices

    def threshold() -> torch.Tensor:
        return scheme.select(v, k, ctx)

    exact(), threshold()  # warm-up
    exact_ms: list[float] = []
    threshold_ms: list[float] = []
    for _ in range(repeat):
        _time_ms(exact, exact_ms)
        _time_ms(threshold, threshold_ms)
    true_top = torch.zeros(numel, dtype=torch.bool)
    true_top[exact()] = True
    recall = float(true_top[threshold()].sum()) / k
    topk_ms, sampled_ms = statistics.median(exact_ms), statistics.median(threshold_ms)
    return {"numel": numel, "density": density, "k": k,
            "topk_ms": topk_ms, "threshold_ms": sampled_ms, "speedup": topk_ms / sampled_ms,
            "recall": recall}


def run(sizes: Sequence[int], repeat: int) -> list[Row]:
    return [measure(n, d, repeat) for n in sizes for d in DENSITIES]
