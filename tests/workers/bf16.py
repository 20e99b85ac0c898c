"""Rank-side half of tests/test_bf16.py: a model whose parameters are bfloat16, trained
with each scheme (run under horovodrun or mpirun)."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from hvd_compress import Compression, Policy
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll
from hvd_compress.torch import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(torch.bfloat16)


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def training(specs: list[str], steps: int = 4) -> dict[str, Any]:
    """Per scheme: a bf16 model initialised differently on each rank, broadcast from rank
    0, trained ``steps`` steps on rank-specific data with SGD momentum (bf16 buffers);
    then every rank's momentum is perturbed differently and broadcast from rank 0.
    Returns, per scheme, the parameters, the momentum buffers and what rank 0 started
    from, all as bfloat16 as trained."""
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    batches = [(torch.randn(16, 32, generator=gen).to(torch.bfloat16),
                torch.randint(0, 10, (16,), generator=gen)) for _ in range(steps)]
    for spec in specs:
        torch.manual_seed(hvd.rank())  # different initial weights on every rank
        model = _model()
        initial = _flat(model.parameters()).clone()
        compression = Compression.parse(spec)
        momentum = 0.0 if compression.name == "dgc" else 0.9  # DGC applies its own momentum
        optimizer = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
            named_parameters=model.named_parameters(), compression=compression,
            policy=Policy(min_numel=256))
        broadcast_parameters(model.state_dict(), root_rank=0)
        broadcast_optimizer_state(optimizer, root_rank=0)
        start = _flat(model.parameters()).clone()
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x).float(), y).backward()
            optimizer.step()
        buffers = [s["momentum_buffer"] for s in optimizer.state.values()
                   if s.get("momentum_buffer") is not None]
        for buffer in buffers:
            buffer.add_(hvd.rank() + 1)
        broadcast_optimizer_state(optimizer, root_rank=0)
        out[spec] = {"initial": initial, "start": start, "params": _flat(model.parameters()),
                     "momentum": _flat(buffers) if buffers else None,
                     "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                     "ratio": optimizer.compression_totals.ratio}
    return out


def bf16_value(rank: int, numel: int = 1000) -> torch.Tensor:
    """Rank ``rank``'s bfloat16 tensor for :func:`collectives` (the parent recomputes it)."""
    gen = torch.Generator().manual_seed(rank)
    return (torch.randn(numel, generator=gen) * 10 ** (rank - 1)).to(torch.bfloat16)


def collectives() -> dict[str, Any]:
    """This rank's bfloat16 tensor through each collective of the Horovod communicator:
    an all-reduce (and an in-place one), an all-gather and an all-to-all."""
    comm = HorovodTorchCommunicator()
    x = bf16_value(hvd.rank())
    inplace = x.clone()
    ops = {"allreduce": AllReduce("r", x), "allreduce_": AllReduce("r_", inplace, True),
           "allgather": AllGather("g", x, (x.numel(),) * comm.size),
           "alltoall": AllToAll("a", x, (400, 600))}
    started = {name: comm.start(f"bf16.{name}", op) for name, op in ops.items()}
    out = {name: comm.wait(handle) for name, handle in started.items()}
    out["inplace_is_input"] = out["allreduce_"] is inplace
    return out
