"""Rank-side half of tests/test_topk_fused.py's horovodrun test: top-k over Horovod's
all-gather with a bucket's frames fused into one collective, and the same steps with one
all-gather per tensor."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.comm.sparse_frames import FramesSum
from hvd_compress.schemes.base import materialize

SHAPES = {"w1": (300, 200), "w2": (64, 1000), "b1": (40,), "w3": (7, 3000), "w4": (50, 90)}


class Counting:
    """Horovod's communicator, counting the fused sparse sums it is handed; ``fused``
    False hides its ``gathers_frames`` (one all-gather per tensor, as before)."""

    def __init__(self, fused: bool) -> None:
        self.inner = HorovodTorchCommunicator()
        self.rank, self.size = self.inner.rank, self.inner.size
        self.gathers_frames = fused
        self.batches = 0

    def start(self, name: str, op: Any) -> Any:
        self.batches += isinstance(op, FramesSum)
        return self.inner.start(name, op)

    def wait(self, handle: Any) -> Any:
        return self.inner.wait(handle)


def train(spec: str, steps: int = 3) -> dict[str, Any]:
    """Per mode (``fused``, ``alone``): every step's aggregates, the final residuals and
    the count of fused sparse sums started."""
    out: dict[str, Any] = {}
    for mode in ("fused", "alone"):
        comm = Counting(mode == "fused")
        pipe = Pipeline(Compression.parse(spec), comm, Policy(min_numel=1000),
                        average=True, bucket_bytes=300_000)
        pipe.plan(list(SHAPES), [torch.Size(s) for s in SHAPES.values()])
        gen = torch.Generator().manual_seed(11 + hvd.rank())
        rows = []
        for _ in range(steps):
            grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
            rows.append({n: materialize(t).clone() for n, t in pipe.reduce(grads).items()})
        residuals = {k: v for k, v in pipe.state_dict()["residuals"].items()
                     if isinstance(v, torch.Tensor)}
        out[mode] = {"steps": rows, "residuals": residuals, "batches": comm.batches}
    return out
