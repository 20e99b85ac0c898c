"""Elastic resizes of the compression state (hvd_compress.elastic.ElasticCompression, which
both bindings' states use), on threaded ranks driven as Horovod drives them: what was
applied plus what is owed equals every gradient submitted, across 3 -> 2 -> 3;
Compression.auto decides again on every new world; what cannot follow a reset is refused."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.elastic import (
    ElasticCompression,
    check_elastic_wiring,
    fold_chunk_residuals,
    owed,
    share_owed,
)
from hvd_compress.schemes.packed import CHUNK_RESIDUAL
from hvd_compress.torch.elastic import CompressionStateHandler
from tests.threaded import on_threads

SHAPES = {"a.weight": torch.Size([24, 40]), "b.weight": torch.Size([8, 8])}
NAMES = sorted(SHAPES)
POLICY = Policy(min_numel=1, compress_1d=True)

SCHEMES = {
    "onebit": lambda: Compression.onebit(bucket_size=64),
    "powersgd": lambda: Compression.powersgd(rank=1, start_iter=0),
    "topk": lambda: Compression.topk(ratio=0.1),
    "dgc": lambda: Compression.dgc(ratio=0.1, momentum=0.0),
}


def _buckets(pipe: Pipeline) -> dict[str, int]:
    out = {}
    for name in NAMES:
        codec = pipe.route(name, SHAPES[name]).packed(torch.device("cpu"))
        out[name] = codec.bucket_size if codec is not None else 1
    return out


def _steps(pipes: list[Pipeline], steps: int, seed: int) -> tuple[dict, dict]:
    """Run ``steps`` steps on every pipeline: (sum of the aggregates, sum of the grads)."""
    gen = torch.Generator().manual_seed(seed)
    grads = [[{n: torch.randn(SHAPES[n], generator=gen) for n in NAMES}
              for _ in pipes] for _ in range(steps)]

    def work(rank: int) -> dict[str, torch.Tensor]:
        applied = {n: torch.zeros(SHAPES[n]) for n in NAMES}
        for step in grads:
            for name in NAMES:
                pipes[rank].submit(name, step[rank][name].clone())
            for name, agg in pipes[rank].wait().items():
                applied[name] += agg
        return applied

    results = on_threads(len(pipes), work)
    for other in results[1:]:  # every rank applies the same aggregate
        for name in NAMES:
            torch.testing.assert_close(other[name], results[0][name], rtol=0, atol=0)
    given = {n: sum(step[r][n] for step in grads for r in range(len(pipes))) for n in NAMES}
    return results[0], given


def _owed_now(pipes: list[Pipeline]) -> list[dict]:
    """Each rank's state with its chunk residuals folded (no collective)."""
    return [fold_chunk_residuals(p.state_dict(), SHAPES, _buckets(p), p.comm.rank,
                                 p.comm.size) for p in pipes]


class World:
    """The ranks' shared side of a threaded world: its group, and a board on which rank 0
    posts what ``broadcast_object`` sends."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.group = ThreadGroup(size, timeout=30)
        self.barrier = threading.Barrier(size, timeout=30)
        self.posted: object = None


class ThreadElastic(ElasticCompression):
    """:class:`ElasticCompression` on a thread of a :class:`World`, as the bindings use it."""

    def __init__(self, pipe: Pipeline, world: World, rank: int) -> None:
        super().__init__()
        self.pipe, self.world, self.rank = pipe, world, rank
        self.snapshot()

    @property
    def pipeline(self) -> Pipeline:
        return self.pipe

    def shapes(self) -> dict[str, torch.Size]:
        return dict(SHAPES)

    def broadcast_object(self, obj: object) -> object:
        if self.rank == 0:
            self.world.posted = copy.deepcopy(obj)
        self.world.barrier.wait()
        got = copy.deepcopy(self.world.posted)
        self.world.barrier.wait()
        return got

    def communicator(self, session: str) -> Communicator:
        del session
        return self.world.group.communicator(self.rank)

    def snapshot(self) -> None:
        self.saved = self.pipe.state_dict()


def _resize(ranks: list[ThreadElastic], size: int, scheme,
            only_leave: bool = False) -> list[ThreadElastic]:
    """Horovod's calls at a resize announced while every old rank is alive: every old rank
    pools (``before_resize``), then in the new world the survivors reset (``on_reset``) and
    every rank syncs, new ranks with a pipeline of their own; when ranks ``only_leave``,
    Horovod skips the sync."""
    on_threads(len(ranks), lambda r: ranks[r].before_resize(only_leave))
    world = World(size)
    out = []
    for rank in range(size):
        if rank < len(ranks):
            ranks[rank].world, ranks[rank].rank = world, rank
            out.append(ranks[rank])
        else:
            pipe = Pipeline(scheme, world.group.communicator(rank), POLICY, average=False)
            out.append(ThreadElastic(pipe, world, rank))

    def reset_and_sync(rank: int) -> None:
        if rank < len(ranks):
            out[rank].on_reset()
        if not only_leave:
            out[rank].sync()

    on_threads(size, reset_and_sync)
    return out


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_applied_plus_owed_is_conserved_across_resizes(scheme_name: str) -> None:
    scheme = SCHEMES[scheme_name]()
    world = World(3)
    ranks = [ThreadElastic(Pipeline(scheme, world.group.communicator(r), POLICY,
                                    average=False), world, r) for r in range(3)]
    on_threads(3, lambda r: ranks[r].sync())  # hvd.elastic.run syncs before training
    applied = {n: torch.zeros(SHAPES[n]) for n in NAMES}
    given = {n: torch.zeros(SHAPES[n]) for n in NAMES}
    for phase, size in enumerate((3, 2, 3)):
        if size != len(ranks):
            ranks = _resize(ranks, size, scheme)
        a, g = _steps([h.pipe for h in ranks], 3, seed=phase)
        for name in NAMES:
            applied[name] += a[name]
            given[name] += g[name]
    still_owed = {n: torch.zeros(SHAPES[n]) for n in NAMES}
    for state in _owed_now([h.pipe for h in ranks]):
        for name, value in owed(state).items():
            still_owed[name] += value.view(SHAPES[name])
    some_owed = sum(float(v.norm()) for v in still_owed.values())
    assert some_owed > 0.1  # every one of these schemes keeps something back
    for name in NAMES:
        torch.testing.assert_close(applied[name] + still_owed[name], given[name],
                                   rtol=1e-4, atol=1e-4)


def test_auto_decides_again_on_every_new_world() -> None:
    """``Compression.auto``: every rank decides at the first sync and again after each
    resize (in ``sync``, or in ``on_reset`` when ranks only left and no sync follows), on
    the new world's size, and every rank holds the same routes."""
    scheme = Compression.auto(Compression.onebit(bucket_size=64), probe_seconds=0.001)
    world = World(2)
    ranks = [ThreadElastic(Pipeline(scheme, world.group.communicator(r), POLICY,
                                    average=False), world, r) for r in range(2)]
    on_threads(2, lambda r: ranks[r].sync())
    for resets, (size, only_leave) in enumerate(((3, False), (2, True)), start=1):
        decisions = [h.pipe.auto_decision for h in ranks]
        assert all(d is not None and d.routes == decisions[0].routes for d in decisions)
        ranks = _resize(ranks, size, scheme, only_leave)
        assert [h.decisions for h in ranks[:2]] == [resets + 1] * 2
    decisions = [h.pipe.auto_decision for h in ranks]
    assert all(d is not None and d.routes == decisions[0].routes for d in decisions)
    assert sorted(decisions[0].routes) == NAMES


class _Wired:
    """What the torch handler reads of a DistributedOptimizer before anything else."""

    def __init__(self, collectives: str, ps: str | None, pipeline: object = None) -> None:
        self._wiring = (None, collectives, ps, None)
        self._pipeline = pipeline

    def _rewire(self, *args: object) -> None:
        raise AssertionError("refused before any rewiring")


@pytest.mark.parametrize("collectives", ["gloo", "nccl"])
def test_torch_state_refuses_a_torch_distributed_group(collectives: str) -> None:
    with pytest.raises(ValueError, match=f"collectives={collectives!r}: a torch.distributed "
                                         "group .* collectives='horovod'"):
        CompressionStateHandler(_Wired(collectives, None))


@pytest.mark.parametrize("wiring", [("horovod", "mpi"), ("horovod", None)])
def test_mpi_parameter_servers_are_refused_saying_what_to_start(wiring) -> None:
    if wiring[1] is None:  # the same check lets Horovod's collectives without servers by
        check_elastic_wiring(*wiring)
        return
    with pytest.raises(ValueError, match=r"ps='mpi'.*mpirun.*python -m ps_server "
                                         r"--workers.*grpc://"):
        CompressionStateHandler(_Wired(*wiring))
    with pytest.raises(ValueError, match="ps='mpi'"):
        check_elastic_wiring(*wiring)  # what the Keras state calls with the exchange's ps


def test_two_level_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match="hierarchy=None"):
        CompressionStateHandler(_Wired("horovod", None, pipeline=object()))


def test_fold_places_the_chunk_residual_at_its_chunk() -> None:
    shapes = {"w": torch.Size([3, 64])}  # 192 elements, buckets of 64: one chunk per rank
    state = {"residuals": {"w": torch.ones(3, 64)},
             "scheme_state": {"w": {CHUNK_RESIDUAL: torch.full((64,), 2.0)}}}
    folded = fold_chunk_residuals(state, shapes, {"w": 64}, rank=1, size=3)
    flat = folded["residuals"]["w"].reshape(-1)
    assert torch.equal(flat[64:128], torch.full((64,), 3.0))
    assert torch.equal(torch.cat([flat[:64], flat[128:]]), torch.ones(128))
    assert CHUNK_RESIDUAL not in folded["scheme_state"]["w"]
    with pytest.raises(ValueError, match="rank 0 of 2 owns 128"):
        fold_chunk_residuals(state, shapes, {"w": 64}, rank=0, size=2)


def test_share_goes_into_dgc_velocity_else_the_residual() -> None:
    state = {"residuals": {"b": torch.ones(2)},
             "scheme_state": {"a": {"velocity": torch.ones(2), "momentum": torch.ones(2)}}}
    shared = share_owed(state, {"a": torch.full((2,), 5.0), "b": torch.full((2,), 7.0)})
    assert torch.equal(shared["scheme_state"]["a"]["velocity"], torch.full((2,), 5.0))
    assert torch.equal(shared["scheme_state"]["a"]["momentum"], torch.ones(2))
    assert "a" not in shared["residuals"]
    assert torch.equal(shared["residuals"]["b"], torch.full((2,), 7.0))
