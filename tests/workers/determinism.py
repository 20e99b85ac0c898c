"""Rank-side half of tests/test_determinism.py: sparse sums on the all-gather route at 3 and
4 ranks, with indices that overlap between ranks and values whose float32 sum depends on
the order they are added in."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.comm.ops import Collective, SparseSum

SHAPES = {"w": (64, 100), "b": (5000,)}
SCALES = (1.0, 1e4, -1e4, 0.7, 5e3)
"""Each rank's scale of the shared large entries: 1 + 1e4 drops the low bits of the 1, so
adding in another order gives other float32 bits (and 4 * 1e4 * 1.3, the largest entry,
stays in float16's range)."""


class Recording:
    """A communicator that passes everything to ``inner`` and keeps this rank's sparse
    pairs, in the order they are started."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, name: str, op: Collective) -> Any:
        if isinstance(op, SparseSum):
            self.pairs[name] = (op.indices.clone(), op.values.clone())
        return self.inner.start(name, op)

    def wait(self, handle: Any) -> Any:
        return self.inner.wait(handle)


def gradients(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Small noise on every entry plus large entries at positions shared by every rank
    (chosen from the step alone), scaled per rank by :data:`SCALES`."""
    out = {}
    for name, shape in SHAPES.items():
        numel = torch.Size(shape).numel()
        shared = torch.Generator().manual_seed(1000 * step + numel)
        positions = torch.randperm(numel, generator=shared)[:numel // 50]
        base = torch.empty(positions.numel()).uniform_(2.0, 4.0, generator=shared)
        own = torch.Generator().manual_seed(7919 * rank + step)
        x = torch.randn(numel, generator=own) * 0.01
        jitter = 1 + 0.1 * torch.randn(positions.numel(), generator=own)
        x[positions] = base * SCALES[rank % len(SCALES)] * jitter
        out[name] = x.view(shape)
    return out


def sparse_sums(specs: list[str], steps: int = 2) -> dict[str, Any]:
    """Per scheme, per step and tensor: the aggregate this rank received and the pairs it
    sent (so the test can sum every rank's pairs itself)."""
    out: dict[str, Any] = {}
    for spec in specs:
        comm = Recording(HorovodTorchCommunicator())
        pipeline = Pipeline(Compression.parse(spec), comm,
                            Policy(min_numel=1, compress_1d=True), average=False)
        rows = []
        for step in range(steps):
            comm.pairs.clear()
            aggregates = pipeline.reduce(gradients(step, hvd.rank()))
            sent = {name: comm.pairs[f"hvdc.{name}.sparse"] for name in SHAPES}
            rows.append({name: {"aggregate": aggregates[name], "indices": sent[name][0],
                                "values": sent[name][1]} for name in SHAPES})
        out[spec] = rows
    return out


def replicas(sparse: list[str], dense: list[str], steps: int = 2) -> dict[str, Any]:
    """:func:`sparse_sums` of ``sparse``, and for every scheme of ``dense`` (the all-reduce
    and compressed all-reduce routes) the aggregates this rank received, per step."""
    out = sparse_sums(sparse, steps)
    for spec in dense:
        pipeline = Pipeline(Compression.parse(spec), HorovodTorchCommunicator(),
                            Policy(min_numel=1, compress_1d=True), average=False)
        out[spec] = [pipeline.reduce(gradients(step, hvd.rank())) for step in range(steps)]
    return out
