"""Two-level compression on in-process ranks: 2 hosts x 2 ranks against the flat route."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hvd_compress import Compression, NonFiniteGradientError, Pipeline, Policy
from hvd_compress.comm.ops import AllGather, AllReduce
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.comm.two_level import HostTwoLevelCommunicator
from hvd_compress.hierarchy import (
    HierarchicalPipeline,
    HostLayout,
    RoundsPipeline,
    check_hierarchy,
    cut,
    horovod_host_communicators,
    host_key,
    solo,
    split_of,
    two_level_pipeline,
)
from tests.threaded import on_threads

HOSTS, LOCAL = 2, 2
WORLD = HOSTS * LOCAL
SHAPES = {"w": (64, 48), "v": (33, 40), "b": (48,), "row": (1, 2048), "s": ()}
SCHEMES = ["none", "fp16", "bf16", "onebit:bucket_size=64", "qsgd:bucket_size=64",
           "terngrad:bucket_size=64", "powersgd:rank=2,start_iter=1", "vote",
           "topk:ratio=0.05", "randomk:ratio=0.05", "threshold:tau=2.0", "dgc:ratio=0.05"]
POLICY = Policy(min_numel=64)


def hierarchical(scheme: Any, plan: bool = True, make: Any = HierarchicalPipeline
                 ) -> list[Any]:
    """One pipeline per global rank ``h * LOCAL + l`` (``make``'s), planned with SHAPES."""
    pipes = [make(scheme, local, cross, POLICY, bucket_bytes=4096)
             for local, cross in two_level_comms()]
    if plan:
        for p in pipes:
            p.plan(list(SHAPES), list(SHAPES.values()))
    return pipes


def two_level_comms() -> list[tuple[Any, Any]]:
    """(in-host, cross-host) communicators per global rank ``h * LOCAL + l``."""
    hosts = [ThreadGroup(LOCAL, timeout=30) for _ in range(HOSTS)]
    cross = [ThreadGroup(HOSTS, timeout=30) for _ in range(LOCAL)]
    return [(hosts[r // LOCAL].communicator(r % LOCAL), cross[r % LOCAL].communicator(r // LOCAL))
            for r in range(WORLD)]


def gradients(step: int, integer: bool = False) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(step)
    out = []
    for _ in range(WORLD):
        grads = {n: torch.randn(s) for n, s in SHAPES.items()}
        out.append({n: g.mul(8).round() if integer else g for n, g in grads.items()})
    return out


def steps(pipes: list[Any], first: int, count: int) -> list[list[dict[str, torch.Tensor]]]:
    """Per step, every rank's aggregates."""
    result = []
    for step in range(first, first + count):
        grads = gradients(step)
        result.append(on_threads(WORLD, lambda r, g=grads: pipes[r].reduce(g[r])))
    return result


def test_none_matches_the_flat_route_bit_for_bit() -> None:
    group = ThreadGroup(WORLD, timeout=30)
    flat = [Pipeline(Compression.none, group.communicator(r), POLICY) for r in range(WORLD)]
    two = hierarchical(Compression.none)
    grads = gradients(0, integer=True)
    want = on_threads(WORLD, lambda r: flat[r].reduce(grads[r]))
    got = on_threads(WORLD, lambda r: two[r].reduce(grads[r]))
    for r in range(WORLD):
        for name, shape in SHAPES.items():
            assert got[r][name].shape == shape
            assert torch.equal(got[r][name], want[0][name]), (r, name)
    # Each local rank carried half of every tensor with enough rows across hosts.
    assert [p.owner for p in two[0].pieces("w")] == [0, 1]
    assert two[0].last_step.collective_bytes["host"] > 0


@pytest.mark.parametrize("spec", SCHEMES)
def test_replicas_agree_and_resume_exactly(spec: str) -> None:
    scheme = Compression.parse(spec)
    pipes = hierarchical(scheme)
    first = steps(pipes, 0, 2)
    saved = [p.state_dict() for p in pipes]
    later = steps(pipes, 2, 2)
    resumed = hierarchical(scheme)
    for p, state in zip(resumed, saved, strict=True):
        p.load_state_dict(state)
    again = steps(resumed, 2, 2)
    for step in first + later:
        for name in SHAPES:
            assert all(torch.equal(step[r][name], step[0][name]) for r in range(WORLD))
            assert step[0][name].isfinite().all()
    # A host's local ranks compress the pieces of the tensors the flat route compresses.
    flat = Pipeline(scheme, ThreadGroup(1).communicator(0), POLICY)
    want = sum(len(pipes[0].pieces(n)) for n, s in SHAPES.items()
               if flat.route(n, torch.Size(s)) is scheme)
    assert sum(p.last_step.compressed_tensors for p in pipes[:LOCAL]) == want > 0 \
        or spec == "none"
    for a, b in zip(later, again, strict=True):
        assert all(torch.equal(a[0][n], b[0][n]) for n in SHAPES), spec
    if spec == "none" or spec.startswith("fp16") or spec.startswith("bf16"):
        mean = {n: sum(g[n] for g in gradients(3)) / WORLD for n in SHAPES}
        for n in SHAPES:
            torch.testing.assert_close(later[1][0][n], mean[n], rtol=0.02, atol=0.02)


def test_two_level_all_reduce_is_the_flat_sum_bit_for_bit() -> None:
    """Integer-valued tensors (sums exact): the flat sum on every rank, whatever the shape
    (fewer elements than local ranks included) and dtype; other collectives refused."""
    comms = [HostTwoLevelCommunicator(local, cross) for local, cross in two_level_comms()]
    assert [c.rank for c in comms] == list(range(WORLD)) and comms[0].size == WORLD
    torch.manual_seed(0)
    shapes = [(7, 5), (1,), (3,), ()]
    inputs = [[torch.randint(-50, 50, s).to(dtype) for s in shapes
               for dtype in (torch.float32, torch.float16, torch.bfloat16)]
              for _ in range(WORLD)]

    def run(r: int) -> list[torch.Tensor]:
        handles = [comms[r].start(f"t{i}", AllReduce("P", x.clone()))
                   for i, x in enumerate(inputs[r])]
        return [comms[r].wait(h) for h in handles]

    out = on_threads(WORLD, run)
    for i, want in enumerate(sum(x[i] for x in inputs) for i in range(len(inputs[0]))):
        for r in range(WORLD):
            assert out[r][i].dtype == want.dtype and torch.equal(out[r][i], want), (r, i)
    assert all(c.take_host_bytes() > 0 for c in comms)
    assert comms[0].host_bytes == 0  # taken
    with pytest.raises(TypeError, match="linear_rounds"):
        comms[0].start("g", AllGather("x", torch.zeros(3), (3,) * WORLD))
    alone = HostTwoLevelCommunicator(solo(), solo())  # one host of one rank
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(alone.wait(alone.start("x", AllReduce("P", x))), torch.arange(6.0)
                       .view(2, 3)) and alone.take_host_bytes() == 0


def test_powersgd_rounds_are_flat_powersgd_summed_in_two_levels() -> None:
    """PowerSGD under hierarchy='host' runs the flat algorithm: its aggregates are flat
    PowerSGD's (the factors summed in another order: equal to rounding; the dense warm-up
    step bit for bit), identical on every rank, resumed exactly, and the host's loopback
    carries the factors, far fewer bytes than the dense sum of whole tensors."""
    spec = "powersgd:rank=2,start_iter=1"
    group = ThreadGroup(WORLD, timeout=30)
    flat = [Pipeline(Compression.parse(spec), group.communicator(r), POLICY, bucket_bytes=4096)
            for r in range(WORLD)]
    two = hierarchical(Compression.parse(spec), make=two_level_pipeline)
    dense = hierarchical(Compression.parse(spec))
    assert isinstance(two[0], RoundsPipeline) and two[0].layout()["split"] == "rounds"
    host_bytes = {}
    for step in range(3):
        grads = gradients(step, integer=True)
        want = on_threads(WORLD, lambda r, g=grads: flat[r].reduce(g[r]))
        got = on_threads(WORLD, lambda r, g=grads: two[r].reduce(g[r]))
        on_threads(WORLD, lambda r, g=grads: dense[r].reduce(g[r]))
        for name in SHAPES:
            assert all(torch.equal(got[r][name], got[0][name]) for r in range(WORLD))
            if step == 0:
                assert torch.equal(got[0][name], want[0][name]), name
            torch.testing.assert_close(got[0][name], want[0][name], rtol=1e-4, atol=1e-4)
        assert two[0].last_step.compressed_tensors == flat[0].last_step.compressed_tensors
        host_bytes[step] = (two[0].last_step.collective_bytes["host"],
                            dense[0].last_step.collective_bytes["host"])
    assert flat[0].last_step.compressed_tensors > 0
    # The dense tensors (bias, row, scalar) still go whole; the matrices as factors.
    assert 0 < host_bytes[2][0] < host_bytes[2][1] / 2, host_bytes
    # Exact resume, each rank from its own state.
    saved = [p.state_dict() for p in two]
    later = steps(two, 3, 2)
    resumed = hierarchical(Compression.parse(spec), make=two_level_pipeline)
    for p, state in zip(resumed, saved, strict=True):
        p.load_state_dict(state)
    again = steps(resumed, 3, 2)
    for a, b in zip(later, again, strict=True):
        assert all(torch.equal(a[r][n], b[r][n]) for r in range(WORLD) for n in SHAPES)
    with pytest.raises(ValueError, match="saved with hierarchy"):
        two[0].load_state_dict({**saved[0], "hierarchy": dense[0].layout()})
    with pytest.raises(ValueError, match="linear"):
        RoundsPipeline(Compression.onebit(), *two_level_comms()[0])


def test_buckets_cross_hosts_while_later_gradients_arrive() -> None:
    """A bucket's pieces start across hosts once the next bucket is complete."""
    pipes = hierarchical(Compression.parse("onebit:bucket_size=64"))
    grads = gradients(0)

    def run(r: int) -> tuple[bool, bool, dict[str, torch.Tensor]]:
        pipes[r].submit("w", grads[r]["w"])
        alone = pipes[r].inner.pending
        for name in list(SHAPES)[1:]:
            pipes[r].submit(name, grads[r][name])
        return alone, pipes[r].inner.pending, pipes[r].wait()

    out = on_threads(WORLD, run)
    assert [(alone, later) for alone, later, _ in out] == [(False, True)] * WORLD
    assert all(torch.equal(o[2]["w"], out[0][2]["w"]) for o in out)
    assert not any(p.pending or p.inner.pending for p in pipes)


def test_a_non_finite_piece_fails_every_rank_and_changes_no_state() -> None:
    pipes = hierarchical(Compression.parse("onebit:bucket_size=64"))
    steps(pipes, 0, 1)
    before = [p.state_dict() for p in pipes]
    grads = gradients(1)
    grads[3]["v"][-1, -1] = float("nan")  # rows owned by local rank 1 only

    def run(r: int) -> str:
        try:
            pipes[r].reduce(grads[r])
        except NonFiniteGradientError as exc:
            return ",".join(exc.names) or "elsewhere"
        return "passed"

    assert sorted(on_threads(WORLD, run)) == ["elsewhere", "elsewhere", "v", "v"]
    for p, state in zip(pipes, before, strict=True):
        after = p.state_dict()
        assert after["steps"] == state["steps"]
        for name, residual in state["residuals"].items():
            assert torch.equal(after["residuals"][name], residual)


def test_unplanned_tensors_and_the_layout() -> None:
    pipes = hierarchical(Compression.parse("powersgd:rank=2,start_iter=0"), plan=False)
    out = steps(pipes, 0, 1)[0]
    assert all(torch.equal(out[r]["w"], out[0]["w"]) for r in range(WORLD))
    pieces = cut(["a", "b", "c"], [torch.Size((10, 10)), torch.Size((8, 8)),
                                   torch.Size((6, 6))], 2, split_of(Compression.none))
    assert [(p.owner, p.start, p.stop) for p in pieces["a"]] == [(0, 0, 50), (1, 50, 100)]
    whole = cut(["a", "b", "c"], [torch.Size((10, 10)), torch.Size((8, 8)),
                                  torch.Size((6, 6))], 2, split_of(Compression.powersgd()))
    assert [whole[n][0].owner for n in "abc"] == [0, 1, 1]
    layout = HostLayout.from_keys(["x", "y", "x", "y"], rank=3)
    assert layout.hosts == ((0, 2), (1, 3))
    assert (layout.host, layout.local_rank, layout.cross_ranks) == (1, 1, (2, 3))
    with pytest.raises(ValueError, match="same number of ranks"):
        HostLayout.from_keys(["x", "x", "y"], rank=0)
    with pytest.raises(ValueError, match="saved with hierarchy"):
        state = pipes[0].state_dict()
        state["hierarchy"] = {**state["hierarchy"], "ranks_per_host": 4}
        pipes[0].load_state_dict(state)


def test_options_the_optimizer_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    scheme = Compression.onebit()
    check_hierarchy(None, scheme, collectives="gloo", ps="mpi")  # flat: anything goes
    for kwargs, words in [({"hierarchy": "rack"}, "one of"),
                          ({"collectives": "gloo"}, "collectives='horovod'"),
                          ({"ps": "mpi"}, "gRPC servers only")]:
        with pytest.raises(ValueError, match=words):
            check_hierarchy(kwargs.pop("hierarchy", "host"), scheme, **kwargs)
    with pytest.raises(ValueError, match=r"Compression\.auto"):
        check_hierarchy("host", Compression.auto())
    monkeypatch.setenv("HVD_COMPRESS_RANKS_PER_HOST", "2")
    assert [host_key(r, "horovod's") for r in range(4)] == [0, 0, 1, 1]
    monkeypatch.setenv("HVD_COMPRESS_RANKS_PER_HOST", "0")
    with pytest.raises(ValueError, match="RANKS_PER_HOST"):
        host_key(0, "horovod's")


class _FakeHorovod:
    """What :func:`horovod_host_communicators` calls of a Horovod binding, for rank 3 of 4
    ranks on 2 hosts; records the process sets it adds."""

    def __init__(self) -> None:
        self.added: list[list[int]] = []
        self.key: Any = None

    def rank(self) -> int:
        return 3

    def cross_rank(self) -> int:
        return 1

    def allgather_object(self, key: Any) -> list[Any]:
        self.key = key
        return [0, 0, 1, 1]  # every rank's host key, $HVD_COMPRESS_RANKS_PER_HOST=2

    def add_process_set(self, ranks: list[int]) -> Any:
        self.added.append(ranks)
        return ("added", tuple(ranks))


def test_host_communicators_use_the_bindings_communicator_on_each_process_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The binding-neutral part the TensorFlow binding reuses: the layout, process sets
    (a registered one reused, the others added in the same order on every rank), and the
    binding's communicator made over each."""
    from horovod.common import process_sets

    monkeypatch.setenv("HVD_COMPRESS_RANKS_PER_HOST", "2")
    monkeypatch.setenv("HVD_COMPRESS_HOST_SHM", "0")  # Horovod's in-host route
    monkeypatch.setattr(process_sets, "_basics", type("Basics", (), {
        "_get_process_set_ids_and_ranks": staticmethod(lambda: {0: [0, 1, 2, 3], 7: [2, 3]})})())
    def communicator(process_set: Any) -> Any:
        return ("communicator", getattr(process_set, "process_set_id", process_set))

    hvd = _FakeHorovod()
    layout, local, cross = horovod_host_communicators(hvd, communicator)
    assert hvd.key == 1
    assert layout.hosts == ((0, 1), (2, 3)) and (layout.local_rank, layout.host) == (1, 1)
    assert layout.cross_ranks == (1, 3)
    assert hvd.added == [[0, 1], [0, 2], [1, 3]]  # [2, 3] was registered (id 7)
    assert local == ("communicator", 7)
    assert cross == ("communicator", ("added", (1, 3)))
