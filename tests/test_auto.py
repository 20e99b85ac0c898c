"""``Compression.auto``: measured costs, routes agreed by every rank, decisions that follow
the link, residuals that follow the route."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress import policy as auto_routes
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.policy import (
    Auto,
    LinkModel,
    RouteCost,
    collectives,
    measure_route,
    predict,
)
from tests.harness import run_ranks
from tests.threaded import on_threads

SHAPES = {"fc1.weight": torch.Size([512, 512]), "fc1.bias": torch.Size([512]),
          "fc2.weight": torch.Size([64, 512]), "tiny.weight": torch.Size([4, 4])}
POWERSGD = "powersgd:rank=2,start_iter=0"


def pipelines(scheme: Auto, size: int, link: LinkModel | None,
              monkeypatch: pytest.MonkeyPatch) -> list[Pipeline]:
    """One pipeline per rank; the link probe answers ``link`` (``None``: really probe)."""
    if link is not None:
        monkeypatch.setattr(auto_routes, "probe_link", lambda *args: link)
    group = ThreadGroup(size, timeout=60)
    return [Pipeline(scheme, group.communicator(r), Policy()) for r in range(size)]


def plan_all(pipes: list[Pipeline]) -> None:
    names = list(SHAPES)
    on_threads(len(pipes), lambda r: pipes[r].plan(names, [SHAPES[n] for n in names]))


def test_parse_and_describe() -> None:
    scheme = Compression.parse("auto:powersgd:rank=2,start_iter=0")
    assert isinstance(scheme, Auto) and scheme.scheme.rank == 2
    assert scheme.describe()["scheme"] == Compression.parse(POWERSGD).describe()
    assert isinstance(Compression.parse("auto").scheme, type(Compression.powersgd()))
    with pytest.raises(ValueError, match="unknown compression scheme 'nope'"):
        Compression.auto("nope")
    with pytest.raises(TypeError, match="other than auto"):
        Compression.auto(Compression.auto())


def test_a_slow_link_compresses_the_large_matrices_and_a_fast_one_sends_dense(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same shapes under a 1 MB/s link and an (almost) free one; the policy's exclusions
    (the bias, the 4x4) are never routed to the scheme."""
    slow = pipelines(Compression.auto(POWERSGD), 2, LinkModel(1e-3, 1e-6), monkeypatch)
    plan_all(slow)
    routes = [p.auto_decision.routes for p in slow]
    assert routes[0] == routes[1]
    assert routes[0]["fc1.weight"] == "scheme" and routes[0]["fc2.weight"] == "scheme"
    assert routes[0]["fc1.bias"] != "scheme" and routes[0]["tiny.weight"] != "scheme"
    assert "scheme" not in slow[0].auto_decision.costs["fc1.bias"]

    fast = pipelines(Compression.auto(POWERSGD), 2, LinkModel(0.0, 1e-15), monkeypatch)
    plan_all(fast)
    assert set(fast[0].auto_decision.routes.values()) == {"dense"}
    assert fast[0].auto_decision.predicted <= fast[0].auto_decision.dense_predicted


def test_measured_costs_count_the_bytes_and_rounds_of_each_route() -> None:
    shape = torch.Size([256, 128])
    dense = measure_route(Compression.none, shape, rank=0, size=4, device=torch.device("cpu"))
    assert dense.rounds == 1 and dense.send_bytes == pytest.approx(1.5 * 4 * shape.numel())
    low = measure_route(Compression.parse(POWERSGD), shape, 0, 4, torch.device("cpu"))
    assert low.rounds == 2 and low.send_bytes == pytest.approx(1.5 * 4 * (256 + 128) * 2)
    half = measure_route(Compression.fp16, shape, 0, 4, torch.device("cpu"))
    assert half.send_bytes == pytest.approx(0.75 * 2 * shape.numel() * 2)  # scatter + gather
    assert min(dense.compute, low.compute, half.compute) >= 0
    costs = {"a": {"dense": dense, "scheme": low}}
    link = LinkModel(0.01, 1e-8)
    assert low.kinds == ("allreduce", "allreduce") and half.kinds == ("alltoall", "allgather")
    assert predict(costs, {"a": "scheme"}, link) == pytest.approx(
        low.compute + low.send_bytes * 1e-8 + 2 * 0.01)
    # A dense tensor's all-reduce rides with P: no collective more. fp16's two rounds are
    # two more collectives, whatever their size.
    both = {"a": costs["a"], "b": {"dense": dense, "fp16": half}}
    assert collectives(both, {"a": "scheme", "b": "dense"}) == 2
    assert collectives(both, {"a": "scheme", "b": "fp16"}) == 4


def test_ranks_apply_rank_zeros_routes_even_when_their_measurements_differ() -> None:
    """Routes come from rank 0 alone: a rank whose own numbers would choose otherwise
    still routes as rank 0 does."""
    group = ThreadGroup(2)

    def decide(rank: int) -> dict[str, str]:
        comm = group.communicator(rank)

        def run(name: str, op: object) -> object:
            return comm.wait(comm.start(name, op))  # type: ignore[arg-type]

        link = LinkModel(0.0, 1e-6 if rank == 0 else 1e-15)
        return Compression.auto(POWERSGD).decide(
            {"w": torch.Size([512, 512])}, lambda s: True, run, rank, 2,
            torch.device("cpu"), link=link).routes

    routes = on_threads(2, decide)
    assert routes[0] == routes[1] == {"w": "scheme"}


def test_training_steps_follow_the_routes_and_the_residual_follows_a_route_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks, slow link: the weight goes through PowerSGD with error feedback. Then the
    routes are decided again for a fast link and the weight goes dense: its residual travels
    once more and is dropped, so the sum of the aggregates equals the sum of the mean
    gradients exactly (up to float32 rounding)."""
    pipes = pipelines(Compression.auto(POWERSGD, recheck_every=0), 2, LinkModel(0.0, 1e-6),
                      monkeypatch)
    names = ["w", "b"]
    shapes = [torch.Size([256, 256]), torch.Size([256])]
    on_threads(2, lambda r: pipes[r].plan(names, shapes))
    assert pipes[0].auto_decision.routes["w"] == "scheme"
    assert pipes[0].auto_decision.routes["b"] != "scheme"  # 1-D: the policy's exclusion
    applied, mean = torch.zeros(256, 256), torch.zeros(256, 256)
    compressed = []
    for step in range(6):
        if step == 3:
            on_threads(2, lambda r: pipes[r].redecide(link=LinkModel(0.0, 1e-15)))
        grads = [{n: torch.randn(s) for n, s in zip(names, shapes)} for _ in range(2)]
        out = on_threads(2, lambda r, grads=grads: pipes[r].reduce(grads[r]))
        assert torch.equal(out[0]["w"], out[1]["w"])
        applied += out[0]["w"]
        mean += (grads[0]["w"] + grads[1]["w"]) / 2
        compressed.append(pipes[0].last_step.compressed_tensors)
        if step == 2:  # PowerSGD left a residual
            assert pipes[0].feedback.get("w") is not None
            torch.testing.assert_close(applied + sum(p.feedback.get("w") for p in pipes) / 2,
                                       mean, rtol=1e-4, atol=1e-4)
    assert min(compressed[:3]) >= 1 and compressed[3:] == [0, 0, 0]  # the bias: measured
    assert pipes[0].feedback.get("w") is None and pipes[1].feedback.get("w") is None
    torch.testing.assert_close(applied, mean, rtol=1e-4, atol=1e-4)


def test_a_recheck_that_finds_the_model_wrong_refits_the_link(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``revise``: a measurement 10x the prediction makes the link slower; one within the
    tolerance changes nothing. The routes' costs depend on the shapes only: they are
    priced again at the refitted link, not measured again."""

    def measure_again(*args: object) -> RouteCost:
        raise AssertionError("revise measured a route's compute again for unchanged shapes")

    monkeypatch.setattr(auto_routes, "measure_route", measure_again)
    group = ThreadGroup(2)
    auto = Compression.auto(POWERSGD, tolerance=0.5)
    shapes = {"w": torch.Size([256, 256])}
    costs = {"w": {"dense": RouteCost(0.0, 1e6, ("allreduce",)),
                   "scheme": RouteCost(0.5, 1e3, ("allreduce", "allreduce"))}}
    current = auto_routes.Decision(LinkModel(0.0, 1e-7), costs, {"w": "dense"}, 0.1, 0.1,
                                   dict(shapes))

    def revise(rank: int, measured: float) -> auto_routes.Decision | None:
        comm = group.communicator(rank)
        return auto.revise(current, measured, shapes, lambda s: True,
                           lambda n, op: comm.wait(comm.start(n, op)), rank, 2,
                           torch.device("cpu"))

    assert on_threads(2, lambda r: revise(r, 0.12)) == [None, None]
    revised = on_threads(2, lambda r: revise(r, 1.0))
    assert revised[0].link.seconds_per_byte == pytest.approx(1e-6)
    assert revised[0].routes == revised[1].routes == {"w": "scheme"}


def test_without_shapes_the_first_step_is_dense_and_decides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pipes = pipelines(Compression.auto(POWERSGD), 2, LinkModel(0.0, 1e-6), monkeypatch)
    xs = [{"w": torch.randn(256, 256)} for _ in range(2)]
    out = on_threads(2, lambda r: pipes[r].reduce(xs[r]))
    torch.testing.assert_close(out[0]["w"], (xs[0]["w"] + xs[1]["w"]) / 2)
    assert pipes[0].last_step.dense_tensors == 1
    assert pipes[0].auto_decision.routes == {"w": "scheme"}
    on_threads(2, lambda r: pipes[r].reduce(xs[r]))
    assert pipes[0].last_step.compressed_tensors == 1


def test_a_real_probe_on_threads_measures_a_positive_link() -> None:
    group = ThreadGroup(2)

    def probe(rank: int) -> LinkModel:
        comm = group.communicator(rank)
        return auto_routes.probe_link(lambda n, op: comm.wait(comm.start(n, op)), 2,
                                      torch.device("cpu"), 0.01)

    links = on_threads(2, probe)
    assert links[0] == links[1]
    assert links[0].latency >= 0 and links[0].seconds_per_byte > 0


def test_one_rank_sends_everything_dense_without_measuring() -> None:
    group = ThreadGroup(1)
    pipe = Pipeline(Compression.auto(POWERSGD), group.communicator(0))
    pipe.plan(["w"], [torch.Size([512, 512])])
    assert pipe.auto_decision.routes == {"w": "dense"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("slow_link", [False, True])
def test_two_horovod_ranks_agree_on_routes_train_identically_and_resume(
        slow_link: bool) -> None:
    """Under ``horovodrun -np 2``: the real probe on loopback, and a probe answering
    1 MB/s (then the convolution and the first linear layer take PowerSGD)."""
    ranks = run_ranks("tests.workers.auto:training", launcher="gloo",
                      spec="auto:powersgd:rank=2,start_iter=0", slow_link=slow_link)
    assert ranks[0]["routes"] == ranks[1]["routes"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert torch.isfinite(ranks[0]["params"]).all()
    for r in ranks:
        assert torch.equal(r["resumed_params"], r["params"])
    if slow_link:
        assert ranks[0]["routes"]["fc1.weight"] == "scheme"
        assert ranks[0]["compressed"] >= 1
