"""Elastic resizes of the compression state (hvd_compress.torch.elastic), on threaded ranks:
what was applied plus what is owed equals every gradient submitted, across 3 -> 2 -> 3."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.packed import CHUNK_RESIDUAL
from hvd_compress.torch.elastic import fold_chunk_residuals, owed, pool_owed, share_owed
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


def _resize(pipes: list[Pipeline], size: int, scheme) -> list[Pipeline]:
    """The module's policy from ``len(pipes)`` ranks to ``size``: pool over the old world,
    survivors keep the rest of their state, new ranks take rank 0's shared state."""
    states = _owed_now(pipes)
    pooled = on_threads(len(pipes), lambda r: pool_owed(owed(states[r]), NAMES, SHAPES,
                                                        pipes[r].comm))
    share = {n: v / size for n, v in pooled[0].items()}
    group = ThreadGroup(size, timeout=30)
    out = []
    for rank in range(size):
        if rank < len(pipes):
            pipe, state = pipes[rank], states[rank]
            pipe.comm = pipe.routes.comm = group.communicator(rank)
        else:
            pipe = Pipeline(scheme, group.communicator(rank), POLICY, average=False)
            state = dict(states[0], residuals={})
        pipe.load_state_dict(share_owed(state, share))
        out.append(pipe)
    return out


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_applied_plus_owed_is_conserved_across_resizes(scheme_name: str) -> None:
    scheme = SCHEMES[scheme_name]()
    group = ThreadGroup(3, timeout=30)
    pipes = [Pipeline(scheme, group.communicator(r), POLICY, average=False) for r in range(3)]
    applied = {n: torch.zeros(SHAPES[n]) for n in NAMES}
    given = {n: torch.zeros(SHAPES[n]) for n in NAMES}
    for phase, size in enumerate((3, 2, 3)):
        if size != len(pipes):
            pipes = _resize(pipes, size, scheme)
        a, g = _steps(pipes, 3, seed=phase)
        for name in NAMES:
            applied[name] += a[name]
            given[name] += g[name]
    still_owed = {n: torch.zeros(SHAPES[n]) for n in NAMES}
    for state in _owed_now(pipes):
        for name, value in owed(state).items():
            still_owed[name] += value.view(SHAPES[name])
    some_owed = sum(float(v.norm()) for v in still_owed.values())
    assert some_owed > 0.1  # every one of these schemes keeps something back
    for name in NAMES:
        torch.testing.assert_close(applied[name] + still_owed[name], given[name],
                                   rtol=1e-4, atol=1e-4)


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
