"""Rank-side halves of tests/test_multiprocess.py (run under horovodrun or mpirun)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from hvd_compress import Compression, NonFiniteGradientError, Pipeline, Policy
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.comm.ops import SparseSum
from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect
from hvd_compress.schemes.dense import FP16, NoCompression
from hvd_compress.torch import DistributedOptimizer, broadcast_optimizer_state

SHAPES = [(33, 17), (256, 40), (1000,), (6, 3, 3, 3)]


def aggregates(specs: list[str], ps: str | None = None) -> dict[str, Any]:
    """One exchange per scheme of rank-specific tensors; return what the parent needs to
    check that the aggregate is the sum of every rank's decoded contribution. ``ps``: sum
    sparse pairs on these parameter servers instead of by Horovod ``allgather``."""
    comm: Communicator = HorovodTorchCommunicator()
    if ps:
        comm = ParameterServerCommunicator(comm, connect(ps, comm.rank), session="aggregates")
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    out: dict[str, Any] = {}
    for spec in specs:
        scheme = Compression.parse(spec)
        pipe = Pipeline(scheme, comm, Policy(min_numel=1, compress_1d=True), average=False)
        tensors = {f"{spec}/t{i}": torch.randn(shape, generator=gen)
                   for i, shape in enumerate(SHAPES)}
        result = pipe.reduce(tensors)
        for name, x in tensors.items():
            if scheme.error_feedback:
                residual = pipe.feedback.get(name)
                sent = x if residual is None else x - residual
            elif isinstance(scheme, FP16):
                sent = x.half().float()
            elif isinstance(scheme, NoCompression):
                sent = x
            else:
                sent = None  # unbiased packed scheme: checked statistically elsewhere
            out[name] = {"x": x, "sent": sent, "aggregate": result[name],
                         "chunk_residual": pipe.scheme_state(name).get("chunk_residual")}
    return out


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.fc1 = nn.Linear(16 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7 + hvd.rank())
    return [(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen))
            for _ in range(steps)]


def _setup(spec: str, seed: int = 0, ps: str | None = None
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Net()
    compression = Compression.parse(spec)
    momentum = 0.0 if compression.name == "dgc" else 0.9  # DGC applies its own momentum
    optimizer = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
        named_parameters=model.named_parameters(), compression=compression,
        policy=Policy(min_numel=256), ps=ps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(optimizer, root_rank=0)
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer,
           batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def training(specs: list[str], steps: int = 6, ps: str | None = None) -> dict[str, Any]:
    """Per scheme: parameters after ``steps`` steps, and whether resuming from a
    checkpoint taken one step earlier reproduces the last step exactly."""
    out: dict[str, Any] = {}
    batches = _batches(steps)
    for spec in specs:
        model, optimizer = _setup(spec, ps=ps)
        _train(model, optimizer, batches[:-1])
        checkpoint = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        _train(model, optimizer, batches[-1:])

        resumed_model, resumed_optimizer = _setup(spec, seed=99, ps=ps)
        resumed_model.load_state_dict(checkpoint[0])
        resumed_optimizer.load_state_dict(checkpoint[1])
        _train(resumed_model, resumed_optimizer, batches[-1:])
        out[spec] = {"params": _flat(model),
                     "resumed_params": _flat(resumed_model),
                     "ratio": optimizer.compression_totals.ratio}
    return out


def nonfinite(spec: str) -> dict[str, Any]:
    """Rank 1 feeds a NaN; every rank must raise, keep its state, and then go on."""
    comm = HorovodTorchCommunicator()
    pipe = Pipeline(Compression.parse(spec), comm, Policy(min_numel=1))
    good = {"w": torch.randn(64, 32), "v": torch.randn(16, 16)}
    pipe.reduce(good)
    before = pipe.state_dict()
    bad = {k: v.clone() for k, v in good.items()}
    if hvd.rank() == 1:
        bad["w"][3, 5] = float("nan")
    error = None
    try:
        pipe.reduce(bad)
    except NonFiniteGradientError as exc:
        error = {"names": exc.names, "local": exc.local, "message": str(exc)}
    after = pipe.state_dict()
    unchanged = before["steps"] == after["steps"] and all(
        torch.equal(before["residuals"][k], after["residuals"][k]) for k in before["residuals"])
    unchanged = unchanged and set(before["residuals"]) == set(after["residuals"])
    recovered = pipe.reduce(good)
    return {"error": error, "unchanged": unchanged,
            "recovered_finite": all(bool(t.isfinite().all()) for t in recovered.values())}


def late_partner(delay: float, ps: str | None = None) -> dict[str, Any]:
    """Rank 1 joins a sparse sum ``delay`` seconds after rank 0 (through Horovod's
    allgather, or the parameter servers ``ps``); each rank reports the wall seconds its
    wait took, the CPU seconds of the waiting thread (Horovod's own background thread
    apart), and the sum."""
    comm: Communicator = HorovodTorchCommunicator()
    if ps:
        comm = ParameterServerCommunicator(comm, connect(ps, comm.rank), session="late")
    rank = hvd.rank()

    def pair() -> SparseSum:
        return SparseSum("late", 4, torch.tensor([rank]), torch.tensor([rank + 1.0]))

    comm.wait(comm.start("warm-up", pair()))
    if rank == 1:
        time.sleep(delay)
    wall, cpu = time.perf_counter(), time.thread_time()
    total = comm.wait(comm.start("late", pair()))
    return {"wall": time.perf_counter() - wall, "cpu": time.thread_time() - cpu,
            "sum": total}


def stock_optimizer() -> dict[str, Any]:
    """Horovod's own DistributedOptimizer with our schemes."""
    out: dict[str, Any] = {}
    x, y = _batches(1)[0]
    torch.manual_seed(0)
    model = _Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=Compression.fp16)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.synchronize()
    out["fp16_local"] = local
    out["fp16_aggregate"] = {n: p.grad.clone() for n, p in model.named_parameters()}

    for spec in ("onebit", "bf16"):
        torch.manual_seed(0)
        model = _Net()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             compression=Compression.parse(spec))
        try:
            nn.functional.cross_entropy(model(x), y).backward()
            out[spec] = None
        except TypeError as exc:
            out[spec] = str(exc)
    return out


def digits(specs: list[str], epochs: int, ps: str | None = None) -> dict[str, float]:
    """Test accuracy on scikit-learn's digits after ``epochs`` epochs, per scheme."""
    from examples.digits import train

    torch.set_num_threads(1)
    return {spec: train(spec, epochs=epochs, ps=ps).test_accuracy for spec in specs}


def through_restart(ps: str, marker: str, steps: int, pause_at: int) -> torch.Tensor:
    """Top-k training through the server; at step ``pause_at`` rank 0 creates ``marker``
    (the test then kills the server and restarts it) and the steps slow down so that some
    of them meet the outage. Returns the final parameters."""
    model, optimizer = _setup("topk:ratio=0.05", ps=ps)
    for step, (x, y) in enumerate(_batches(steps)):
        if step == pause_at and hvd.rank() == 0:
            Path(marker).write_text("killing the server now")
        if step >= pause_at:
            time.sleep(0.2)
        _train(model, optimizer, [(x, y)])
    return _flat(model)


def sparse(aggregate_specs: list[str], train_specs: list[str],
           ps: str | None = None) -> dict[str, Any]:
    """:func:`aggregates` and :func:`training` in one launch."""
    return {"aggregates": aggregates(aggregate_specs, ps),
            "training": training(train_specs, ps=ps)}
