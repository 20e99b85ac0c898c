"""The pipeline's eager phases (:attr:`~hvd_compress.pipeline.Pipeline.eager_phases`): a
bucket's later rounds start when the next bucket starts, not in ``wait()``; the results are
those of the lazy order bit for bit, and every rank starts the same sequence."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.threads import ThreadGroup
from tests.threaded import RecordingCommunicator, on_threads

# Backward order; with 80 kB buckets: [head, head_b, l2] [l1, l1_b, norm] [emb].
SHAPES = {"head": (96, 64), "head_b": (96,), "l2": (128, 96), "l1": (96, 128),
          "l1_b": (96,), "norm": (128,), "emb": (200, 96)}
BUCKET_BYTES = 80 << 10
POLICY = Policy(min_numel=16)


def _pipelines(eager: bool, size: int, ordered: bool) -> list[Pipeline]:
    group = ThreadGroup(size, timeout=30)
    pipes = []
    for r in range(size):
        comm = RecordingCommunicator(group.communicator(r))
        comm.ordered = ordered  # type: ignore[attr-defined]
        pipe = Pipeline(Compression.parse("powersgd:rank=4,start_iter=1"), comm, POLICY,
                        bucket_bytes=BUCKET_BYTES)
        pipe.eager_phases = eager
        pipe.plan(list(SHAPES), [torch.Size(s) for s in SHAPES.values()])
        pipes.append(pipe)
    return pipes


def _run(eager: bool, size: int, steps: int, ordered: bool = True
         ) -> tuple[list[list[dict[str, torch.Tensor]]], list[Pipeline]]:
    pipes = _pipelines(eager, size, ordered)
    gen = torch.Generator().manual_seed(11 + size)
    outs = []
    for _ in range(steps):
        grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
                 for _ in range(size)]

        def step(r: int, g: list[dict[str, torch.Tensor]] = grads) -> dict[str, torch.Tensor]:
            for name, grad in g[r].items():  # in plan (backward) order
                pipes[r].submit(name, grad)
            return pipes[r].wait()

        outs.append(on_threads(size, step))
    return outs, pipes


@pytest.mark.parametrize("size", [1, 3])
def test_eager_equals_lazy_bit_for_bit(size: int) -> None:
    """Aggregates, residuals and PowerSGD's kept ``Q`` of four steps (warm-up, first draw,
    warm starts) are those of the lazy order; replicas are identical."""
    assert len(_pipelines(True, 1, True)[0].buckets) == 3
    eager, pipes_e = _run(True, size, 4)
    lazy, pipes_l = _run(False, size, 4)
    for step, (outs_e, outs_l) in enumerate(zip(eager, lazy, strict=True)):
        for r in range(size):
            for name, value in outs_e[r].items():
                assert torch.equal(value, outs_l[r][name]), f"step {step} rank {r} {name}"
                assert torch.equal(value, outs_e[0][name]), f"replicas: step {step} {name}"
    for pe, pl in zip(pipes_e, pipes_l, strict=True):
        for name in SHAPES:
            ee, el = pe.feedback.get(name), pl.feedback.get(name)
            assert (ee is None) == (el is None), name
            if ee is not None:
                assert torch.equal(ee, el), f"residual of {name}"
            se, sl = pe.scheme_state(name), pl.scheme_state(name)
            assert se.keys() == sl.keys(), name
            for key in se:
                assert torch.equal(se[key], sl[key]), f"state {key} of {name}"


def _rounds(pipe: Pipeline, last: int) -> list[str]:
    """The rounds of the last ``last`` collectives ``pipe``'s communicator started."""
    return [op.round for _, op in pipe.comm.started[-last:]]  # type: ignore[attr-defined]


def test_eager_starts_each_bucket_q_before_the_next_bucket_p() -> None:
    """Past the warm-up, on a communicator matching collectives by start order: eager, a
    bucket's ``Q`` starts when the next bucket starts, and every rank starts the same
    names in the same order; lazy, every ``Q`` starts after every ``P``."""
    _, eager = _run(True, 2, 3)
    _, lazy = _run(False, 2, 3)
    count = eager[0].last_step.collectives
    assert count == lazy[0].last_step.collectives == 6
    assert _rounds(eager[0], count) == ["P+dense", "Q", "P+dense", "Q", "P", "Q"]
    assert _rounds(lazy[0], count) == ["P+dense", "P+dense", "P", "Q", "Q", "Q"]
    names = [p.comm.names for p in eager]  # type: ignore[attr-defined]
    assert names[0] == names[1]


def test_not_on_a_communicator_matching_by_name() -> None:
    """On a communicator that matches collectives by name, ranks completing buckets in
    different orders (here: rank 1 submits in reverse) would deadlock if a bucket's start
    waited for earlier ones: no phase is waited for before ``wait()``, and the step ends
    with the same results on both ranks."""
    pipes = _pipelines(True, 2, ordered=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}

        def step(r: int, g: dict[str, torch.Tensor] = grads) -> dict[str, torch.Tensor]:
            for name in (list(g) if r == 0 else list(g)[::-1]):
                pipes[r].submit(name, g[name])
            assert not any(k.startswith("wait") for k in pipes[r]._current.seconds)
            return pipes[r].wait()

        outs = on_threads(2, step)
        for name in SHAPES:
            assert torch.equal(outs[0][name], outs[1][name]), name
    assert pipes[0].last_step.collectives == 6
