"""Rank-side half of tests/test_stats.py: compression statistics logged during training."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import nn

from hvd_compress import Compression, Policy
from hvd_compress.stats import CompressionStats
from hvd_compress.torch import DistributedOptimizer


def logged(steps: int = 6, every: int = 2) -> dict[str, Any]:
    """Train ``steps`` fp16 steps, logging every ``every`` steps to a callable and to a
    TensorBoard ``SummaryWriter``; return what each received and the optimizer's views."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=Compression.fp16, policy=Policy(min_numel=1))
    before = str(optimizer.compression_stats)
    calls: list[tuple[int, CompressionStats]] = []
    with tempfile.TemporaryDirectory() as log_dir:
        writer = SummaryWriter(log_dir)
        optimizer.log_compression_stats(lambda step, stats: calls.append((step, stats)), every)
        callable_only_until = steps // 2
        for step in range(1, steps + 1):
            if step == callable_only_until + 1:
                optimizer.log_compression_stats(writer, every)
            optimizer.zero_grad()
            model(torch.randn(8, 64)).square().mean().backward()
            optimizer.step()
        writer.close()
        events = EventAccumulator(log_dir)
        events.Reload()
        scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
                   for tag in events.Tags()["scalars"]}
    return {"before": before, "calls": [(s, st.to_dict(), str(st)) for s, st in calls],
            "scalars": scalars, "last": optimizer.compression_stats,
            "last_dict": optimizer.compression_stats.to_dict(),
            "totals": optimizer.compression_totals.to_dict(),
            "totals_str": str(optimizer.compression_totals),
            "numel": sum(p.numel() for p in model.parameters())}
