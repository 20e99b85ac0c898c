"""0/1 Adam on real ranks: what every step leaves and sends."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from hvd_compress.torch import ZeroOneAdam
from tests import convergence_harness as harness


def per_step(steps: int, **options: Any) -> dict[str, Any]:
    """The digits model (the same start on every rank) trained ``steps`` steps by
    ``ZeroOneAdam(**options)`` on batches drawn from this rank's seed: after each step the
    flat parameters, the step's ``payload_bytes``, ``dense_bytes`` and collectives, and
    whether the optimizer announced it as a step that exchanges (``syncs``)."""
    torch.set_num_threads(1)
    model = harness.make_model()
    optimizer = ZeroOneAdam(model.parameters(), lr=1e-3,
                            named_parameters=model.named_parameters(), **options)
    x, y = harness.digits()[:2]
    order = torch.Generator().manual_seed(hvd.rank())
    out: dict[str, Any] = {"params": [], "payload": [], "dense": [], "collectives": [],
                           "syncs": []}
    for _ in range(steps):
        idx = torch.randint(len(x), (32,), generator=order)
        out["syncs"].append(optimizer.syncs)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
        stats = optimizer.compression_stats
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        out["payload"].append(stats.payload_bytes)
        out["dense"].append(stats.dense_bytes)
        out["collectives"].append(stats.collectives)
    return out
