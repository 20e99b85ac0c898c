"""Majority vote on real ranks: each rank's signs and the aggregate it received."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator


def votes(numels: list[int], seed: int = 0) -> dict[str, Any]:
    """One exchange of ``len(numels)`` tensors through the compressed all-reduce, summed
    (not averaged); returns this rank's inputs, the aggregates and the step's bytes."""
    gen = torch.Generator().manual_seed(seed + hvd.rank())
    xs = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(numels)}
    xs["t0"][:16] = 0.0  # exact zeros vote +1
    pipeline = Pipeline(Compression.vote(), HorovodTorchCommunicator(),
                        Policy(min_numel=1, compress_1d=True), average=False)
    out = pipeline.reduce(xs)
    return {"x": xs, "aggregate": out, "bytes": dict(pipeline.last_step.collective_bytes)}
