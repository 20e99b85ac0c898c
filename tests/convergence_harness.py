"""Train scikit-learn's digits on ``size`` ranks of a :class:`ThreadGroup`, one pipeline
and one model copy per rank, the way :class:`hvd_compress.torch.DistributedOptimizer`
drives its pipeline: backward, exchange every gradient (averaged), then the wrapped
optimizer's ``step()``. Used by the convergence tests: fast, in one process, and with the
same pipeline code a Horovod run uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from hvd_compress import Pipeline, Policy
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.base import Scheme
from tests.threaded import on_threads

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

_DATA: tuple[torch.Tensor, ...] | None = None


def digits() -> tuple[torch.Tensor, ...]:
    """Digits scaled to [0, 1]: 1437 training and 360 test images (a fixed permutation)."""
    global _DATA
    if _DATA is None:
        data = load_digits()
        x = torch.from_numpy(data.data.astype(np.float32) / 16.0)
        y = torch.from_numpy(data.target.astype(np.int64))
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
        _DATA = (x[:1437], y[:1437], x[1437:], y[1437:])
    return _DATA


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


@dataclass
class Run:
    """What one rank saw: the training loss per step, the final test accuracy (%),
    the final parameters and the pipeline it ran."""

    losses: list[float] = field(default_factory=list)
    accuracy: float = 0.0
    params: torch.Tensor | None = None
    pipeline: Pipeline | None = None

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last 20 steps (``inf`` if any was not finite)."""
        tail = self.losses[-20:]
        return float(np.mean(tail)) if all(np.isfinite(tail)) else float("inf")


def train(scheme: Scheme, make_optimizer: OptimizerFactory, steps: int = 300,
          size: int = 2, batch_size: int = 32, seed: int = 0,
          policy: Policy | None = None, check: bool = True) -> list[Run]:
    """Train ``steps`` steps on ``size`` ranks (rank ``r`` draws its batches from the
    ``r``-th shard of the training set); every rank's :class:`Run`. ``check``: first call
    ``scheme.check_optimizer`` as the optimizer wrapper does (its errors and warnings
    reach the caller); ``False`` runs a configuration the wrapper would refuse."""
    if check:
        scheme.check_optimizer(make_optimizer(list(make_model(seed).parameters())))
    group = ThreadGroup(size, timeout=120)
    initial = make_model(seed).state_dict()  # the seed is global: not drawn on threads

    def work(rank: int) -> Run:
        model = make_model(seed)
        model.load_state_dict(initial)
        optimizer = make_optimizer(list(model.parameters()))
        pipeline = Pipeline(scheme, group.communicator(rank), policy or Policy(), seed=seed)
        named = list(model.named_parameters())

        def exchange() -> None:
            for name, p in named:
                pipeline.submit(name, p.grad)
            pipeline.wait({name: p.grad for name, p in named})

        return _loop(model, optimizer, exchange, rank, size, steps, batch_size, seed,
                     Run(pipeline=pipeline))

    return on_threads(size, work)


def train_exchanging(make_optimizer: Callable[[nn.Module, Communicator], torch.optim.Optimizer],
                     steps: int = 300, size: int = 2, batch_size: int = 32, seed: int = 0
                     ) -> list[tuple[Run, torch.optim.Optimizer]]:
    """Like :func:`train` for an optimizer that exchanges gradients itself in ``step()``
    (:class:`hvd_compress.torch.OneBitAdam`): ``make_optimizer(model, comm)`` gets each
    rank's model and :class:`ThreadGroup` communicator. Each rank's run and optimizer."""
    group = ThreadGroup(size, timeout=120)
    initial = make_model(seed).state_dict()

    def work(rank: int) -> tuple[Run, torch.optim.Optimizer]:
        model = make_model(seed)
        model.load_state_dict(initial)
        optimizer = make_optimizer(model, group.communicator(rank))
        return _loop(model, optimizer, lambda: None, rank, size, steps, batch_size, seed,
                     Run()), optimizer

    return on_threads(size, work)


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, exchange: Callable[[], None],
          rank: int, size: int, steps: int, batch_size: int, seed: int, run: Run) -> Run:
    """``steps`` steps of rank ``rank`` on its shard: backward, ``exchange()``, step."""
    x_train, y_train, x_test, y_test = digits()
    loss_fn = nn.CrossEntropyLoss()
    xs, ys = x_train[rank::size], y_train[rank::size]
    order = torch.Generator().manual_seed(seed + 1 + rank)
    for _ in range(steps):
        idx = torch.randint(len(xs), (batch_size,), generator=order)
        optimizer.zero_grad()
        loss = loss_fn(model(xs[idx]), ys[idx])
        loss.backward()
        run.losses.append(loss.item())
        exchange()
        optimizer.step()
    with torch.no_grad():
        run.accuracy = 100.0 * float((model(x_test).argmax(1) == y_test).float().mean())
        run.params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return run


def sgd(lr: float = 0.1, momentum: float = 0.9) -> OptimizerFactory:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def adamw(lr: float = 1e-3) -> OptimizerFactory:
    return lambda params: torch.optim.AdamW(params, lr=lr)
