"""Rank-side halves of tests/test_gloo.py: the dense rounds on a Gloo group beside Horovod."""

from __future__ import annotations

import os
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.gloo_torch import GlooCommunicator, horovod_gloo_group
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.torch import DistributedOptimizer
from tests.workers.dense import SHAPES, _batches, _flat, _Net


def aggregates(specs: list[str]) -> dict[str, Any]:
    """Per scheme and tensor, the aggregate of one exchange over Horovod and over Gloo; per
    scheme, the kinds of request the Gloo communicator handed to its Horovod fallback."""
    horovod = HorovodTorchCommunicator()
    fallback = HorovodTorchCommunicator()
    handed: list[str] = []

    def start(name: str, op: Any, start: Any = fallback.start) -> Any:
        handed.append(type(op).__name__)
        return start(name, op)

    fallback.start = start  # type: ignore[method-assign]
    gloo = GlooCommunicator(horovod_gloo_group(hvd), fallback)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    out: dict[str, Any] = {}
    for spec in specs:
        tensors = {f"{spec}/t{i}": torch.randn(shape, generator=gen).to(
            torch.bfloat16 if spec == "bf16-grads" else torch.float32)
            for i, shape in enumerate(SHAPES)}
        scheme = Compression.parse("none" if spec == "bf16-grads" else spec)
        for label, comm in (("horovod", horovod), ("gloo", gloo)):
            pipe = Pipeline(scheme, comm, Policy(min_numel=1, compress_1d=True), average=False)
            for name, result in pipe.reduce(tensors).items():
                out.setdefault(name, {})[label] = result
            out.setdefault(spec, {})[f"{label}_collectives"] = pipe.last_step.collectives
        out[spec]["handed_to_horovod"] = sorted(set(handed))
        handed.clear()
    return out


def _model(spec: str, collectives: str, bucket_mb: float | None
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net()
    compression = Compression.parse(spec)
    optimizer = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), compression=compression,
        policy=Policy(min_numel=256), bucket_mb=bucket_mb, collectives=collectives)
    return model, optimizer


def training(specs: list[str], steps: int = 5, bucket_mb: float | None = 0.01
             ) -> dict[str, Any]:
    """Per scheme: the parameters after ``steps`` steps over Horovod and over Gloo, and
    the collectives of the last step of each. Several buckets (``bucket_mb``), so buckets
    complete during backward."""
    batches = _batches(steps)
    out: dict[str, Any] = {}
    for spec in specs:
        row: dict[str, Any] = {}
        for collectives in ("horovod", "gloo"):
            model, optimizer = _model(spec, collectives, bucket_mb)
            for x, y in batches:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
            row[collectives] = _flat(model)
            row[f"{collectives}_collectives"] = optimizer.compression_stats.collectives
        out[spec] = row
    return out


def refused_address(address: str) -> str:
    """What building a ``collectives="gloo"`` optimizer raises with ``$MASTER_ADDR`` set to
    ``address`` (on every rank, not only on rank 0)."""
    os.environ["MASTER_ADDR"] = address
    try:
        _model("none", "gloo", None)
    except ValueError as exc:
        return str(exc)
    return "no error"
