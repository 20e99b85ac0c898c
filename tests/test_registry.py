"""The scheme registry: a scheme defined here, registered with one call, is known to
``Compression`` and ``Compression.parse`` and trains a model through the pipeline."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch

from hvd_compress import Compression, Policy, compression, registry
from hvd_compress.bench import SCHEMES, SPARSE_SCHEMES
from hvd_compress.comm.ops import AllReduce
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.compression import SCHEME_NAMES
from hvd_compress.policy import Auto, AutoRoutes, Routes, routes_for
from hvd_compress.registry import register_scheme, unregister_scheme
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scheme
from tests.threaded import make_pipelines, on_threads


class Grid(Scheme):
    """A toy scheme: every element rounded to a multiple of ``step``, then summed by an
    all-reduce; what rounding lost is carried by error feedback."""

    name = "grid"
    error_feedback = True

    def __init__(self, step: float = 0.25) -> None:
        if step <= 0:
            raise ValueError(f"grid: step must be > 0, got {step}")
        self.step = step

    def options(self) -> dict[str, float]:
        return {"step": self.step}

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        sent = torch.round(x / self.step) * self.step
        total = yield AllReduce("grid", sent.clone())
        return Outcome(total, sent, 4 * x.numel())

    def payload_bytes(self, shape: torch.Size) -> int:
        return 4 * shape.numel()


@pytest.fixture
def grid() -> Iterator[type[Grid]]:
    register_scheme("grid", Grid)
    try:
        yield Grid
    finally:
        unregister_scheme("grid")


def test_a_registered_scheme_is_named_and_parsed_like_a_built_in(grid: type[Grid]) -> None:
    assert Compression.grid is grid
    assert "grid" in registry.names() and "grid" in dir(Compression)
    assert compression.SCHEME_NAMES == (*SCHEME_NAMES, "grid")
    scheme = Compression.parse("grid:step=0.5")
    assert isinstance(scheme, Grid) and scheme.step == 0.5
    assert Compression.parse("auto:grid").scheme.step == 0.25
    with pytest.raises(ValueError, match="must be a number"):
        Compression.parse("grid:step=coarse")
    with pytest.raises(ValueError, match="exists already"):
        register_scheme("grid", Grid)


def test_unregistered_and_bad_names_are_refused() -> None:
    assert "grid" not in registry.names()
    with pytest.raises(AttributeError, match="no scheme 'grid'"):
        _ = Compression.grid
    with pytest.raises(ValueError, match="unknown compression scheme 'grid'"):
        Compression.parse("grid")
    for name in ("Grid", "parse", "two words", "_grid"):
        with pytest.raises(ValueError, match="not usable as a scheme name"):
            register_scheme(name, Grid)
    with pytest.raises(TypeError, match="Scheme subclass"):
        register_scheme("grid", 3)
    with pytest.raises(ValueError, match="was not added"):
        unregister_scheme("fp16")


def test_the_table_gives_every_list_of_schemes() -> None:
    names = registry.names()
    assert SCHEME_NAMES == names and len(set(names)) == len(names)
    for name in names:
        assert f"Compression.{name}" in Compression.__doc__
    assert SCHEMES + SPARSE_SCHEMES == tuple(s for e in registry.TABLE for s in e.bench)
    for spec in SPARSE_SCHEMES:
        assert next(e for e in registry.TABLE if e.name == spec.partition(":")[0]).sparse


def train(scheme: Scheme, ranks: int = 2, steps: int = 30) -> tuple[list[float], list]:
    """Train ``y = x @ w_true`` on ``ranks`` threads, each on its own batches, with a
    pipeline per rank; the losses of rank 0 and every step's averaged weight gradient."""
    w_true = torch.arange(1.0, 9.0).view(8, 1) / 4
    pipes = make_pipelines(scheme, ranks, Policy(min_numel=1), average=True)
    models = [torch.nn.Linear(8, 1) for _ in range(ranks)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    losses: list[float] = []
    aggregates: list[list[torch.Tensor]] = [[] for _ in range(ranks)]

    def work(rank: int) -> None:
        model, pipe = models[rank], pipes[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(32, 8, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
            opt.zero_grad()
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            for name, avg in pipe.reduce(grads).items():
                grads[name].copy_(avg)
            aggregates[rank].append(grads["weight"].clone())
            opt.step()
            if rank == 0:
                losses.append(float(loss.detach()))

    on_threads(ranks, work)
    assert all(torch.equal(a, b) for a, b in zip(aggregates[0], aggregates[1]))
    return losses, aggregates[0]


def test_a_registered_scheme_trains_and_its_rounding_shows_in_the_aggregate(
        grid: type[Grid]) -> None:
    step = 0.5
    losses, aggregates = train(Compression.parse(f"grid:step={step}"))
    # Every rank sends multiples of ``step``; their average over 2 ranks is a multiple of
    # step / 2, and the weight's gradient is routed to the scheme (the bias goes dense).
    for aggregate in aggregates:
        units = aggregate / (step / 2)
        assert torch.equal(units, torch.round(units))
    assert any(bool((a != 0).any()) for a in aggregates)
    assert losses[-1] < 0.2 * losses[0]
    dense_losses, dense = train(Compression.none)
    assert not all(torch.equal(a, d) for a, d in zip(aggregates, dense))
    assert dense_losses[-1] < 0.2 * dense_losses[0]


def test_auto_is_a_router_in_the_table_not_a_scheme() -> None:
    auto = Compression.parse("auto:topk:ratio=0.01")
    assert isinstance(auto, Auto) and not isinstance(auto, Scheme)
    assert not hasattr(auto, "exchange")
    assert auto.describe() == {"name": "auto", "scheme": Compression.topk(0.01).describe(),
                               "fp16": True}
    with pytest.raises(TypeError, match=r"hvd_compress\.torch\.DistributedOptimizer"):
        auto.compress(torch.zeros(4))  # Horovod's stateless interface is refused
    comm = ThreadGroup(1).communicator(0)
    assert type(routes_for(auto, Policy(), comm)) is AutoRoutes
    fixed = routes_for(Compression.fp16, Policy(), comm)
    assert type(fixed) is Routes and fixed.state_dict() == {}
    with pytest.raises(TypeError, match=r"redecide\(\) needs Compression\.auto"):
        fixed.redecide(torch.device("cpu"))
