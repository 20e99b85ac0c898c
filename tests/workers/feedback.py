"""Rank-side half of tests/test_feedback.py: ``compression_feedback`` read after steps of
the torch optimizer, for schemes with and without a residual."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from hvd_compress import Compression
from hvd_compress.torch import DistributedOptimizer

SCHEMES = {"fp16": Compression.fp16, "terngrad": Compression.terngrad(),
           "dgc": Compression.dgc(ratio=0.01)}


def reports(steps: int = 3) -> dict[str, Any]:
    """Per scheme: ``compression_feedback`` after ``steps`` steps on this rank's own
    batches, with this rank's local gradient of the first weight at the last step (taken
    by ``torch.autograd.grad``, which leaves the optimizer's hooks alone)."""
    out: dict[str, Any] = {}
    for label, scheme in SCHEMES.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=scheme, report_every=1)
        data = torch.Generator().manual_seed(100 + hvd.rank())
        local = torch.zeros(0)
        for _ in range(steps):
            optimizer.zero_grad()
            x = torch.randn(16, 64, generator=data)
            loss = model(x).square().mean()
            (local,) = torch.autograd.grad(loss, model[0].weight, retain_graph=True)
            loss.backward()
            optimizer.step()
        out[label] = {"report": optimizer.compression_feedback, "local": local.clone()}
    return out
