"""Rank-side half of tests/test_hierarchy_multiprocess.py: the torch optimizer with
``hierarchy="host"`` on 4 Horovod ranks grouped into 2 emulated hosts."""

from __future__ import annotations

import os
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from hvd_compress import Compression, Policy
from hvd_compress.torch import DistributedOptimizer

SHAPES = {"w": (64, 48), "v": (33, 40), "b": (48,), "row": (1, 512)}
LOOPBACK = ("none", "onebit:bucket_size=64", "topk:ratio=0.05")
"""Schemes also run with the in-host stage over loopback TCP ($HVD_COMPRESS_HOST_SHM=0)."""


class _Linear(nn.Module):
    """A loss ``sum(p * c)``: the gradient of each parameter is exactly ``c``."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))

    def loss(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
        return sum(((p * torch.randint(-8, 9, p.shape, generator=gen).float()).sum()
                    for p in self.parameters()), torch.zeros(()))


def _train(spec: str, hierarchy: str | None, first: int, count: int,
           start: dict[str, Any] | None = None, ps: str | None = None
           ) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any]:
    model = _Linear()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters(),
                               compression=Compression.parse(spec), policy=Policy(min_numel=64),
                               bucket_mb=0.01, hierarchy=hierarchy, ps=ps)
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
    for step in range(first, first + count):
        opt.zero_grad()
        model.loss(step).backward()
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipeline = opt._pipeline  # type: ignore[attr-defined]
    stats = {**opt.compression_stats.to_dict(), "cross": type(pipeline.comm).__name__,
             "layout": pipeline.layout() if hierarchy else None,
             "local": type(pipeline.local).__name__ if hierarchy else None}
    return params, {"model": model.state_dict(), "opt": opt.state_dict()}, stats


def steps(specs: list[str], ps: str | None = None) -> dict[str, Any]:
    """Per scheme: the parameters after 3 steps two-level, after steps 2-3 resumed from
    each rank's own state after step 1, and (``none``, PowerSGD) after 3 flat steps."""
    out: dict[str, Any] = {}
    for spec in specs:
        server = ps if spec.startswith("topk") else None
        two, _, stats = _train(spec, "host", 0, 3, ps=server)
        _, state, _ = _train(spec, "host", 0, 1, ps=server)
        resumed, _, _ = _train(spec, "host", 1, 2, start=state, ps=server)
        out[spec] = {"two": two, "resumed": resumed, "stats": stats}
        if spec in LOOPBACK:  # the in-host stage over Horovod's process set instead
            os.environ["HVD_COMPRESS_HOST_SHM"] = "0"
            try:
                out[spec]["loopback"] = _train(spec, "host", 0, 3, ps=server)[0]
            finally:
                del os.environ["HVD_COMPRESS_HOST_SHM"]
        if spec == "none" or spec.startswith("powersgd"):
            out[spec]["flat"] = _train(spec, None, 0, 3)[0]
    # A host's last all-gather may still run when the other host's ranks are done: no
    # rank exits (shutting Horovod down) before every rank has finished (user guide).
    hvd.barrier()
    return out
