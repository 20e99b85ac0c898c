"""PowerSGD's batched path (:meth:`~hvd_compress.schemes.powersgd.PowerSGD.exchange_many`,
:mod:`hvd_compress.schemes.batched`): a bucket's matrices in one request per round and one
QR per shape give, bit for bit, what the per-tensor exchanges give, on every rank."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression, Policy
from hvd_compress.schemes import powersgd
from hvd_compress.schemes.batched import FlatLayout, batches
from tests.threaded import make_pipelines, on_threads

# Equal shapes (batched QR), a conv kernel, a matrix above TRANSPOSED_UP_TO (its P is not
# transposed at rank 8), one too small to compress and 1-D tensors that go dense.
SHAPES = {"a": (64, 48), "b": (64, 48), "c": (32, 64), "conv": (16, 8, 3, 3),
          "big": (900, 600), "bias": (64,), "tiny": (2, 2), "norm": (48,)}
POLICY = Policy(min_numel=16)


def _run(spec: str, batch: bool, size: int, steps: int, late: str | None = None,
         bucket_bytes: int | None = 64 << 20
         ) -> tuple[list[list[dict[str, torch.Tensor]]], list, int]:
    """``steps`` steps on ``size`` ranks: every rank's aggregates per step, each rank's
    pipeline, and the collectives of the last step. ``late`` joins from the second step."""
    scheme = Compression.parse(spec)
    scheme.batch_tensors = batch
    pipes = make_pipelines(scheme, size, POLICY, bucket_bytes=bucket_bytes)
    gen = torch.Generator().manual_seed(size * 7 + len(spec))
    outs: list[list[dict[str, torch.Tensor]]] = []
    for step in range(steps):
        grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()
                  if n != late or step > 0} for _ in range(size)]
        outs.append(on_threads(size, lambda r, g=grads: pipes[r].reduce(g[r])))
    return outs, pipes, pipes[0].last_step.collectives


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and torch.equal(a, b), what


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("spec", ["powersgd:rank=2,start_iter=1",
                                  "powersgd:rank=8,start_iter=1",
                                  "powersgd:rank=4,start_iter=0,warm_start=False",
                                  "powersgd:rank=4,start_iter=1,alternate=True"])
def test_batched_equals_per_tensor_bit_for_bit(spec: str, size: int) -> None:
    """Aggregates, residuals and kept state of four steps (warm-up, first draw, warm
    starts; a tensor joining late, so that its steps lag the others': alternate then runs
    both sides in one step) equal the per-tensor path's; replicas are identical."""
    batched, pipes_b, _ = _run(spec, True, size, 4, late="c")
    single, pipes_s, _ = _run(spec, False, size, 4, late="c")
    for step, (outs_b, outs_s) in enumerate(zip(batched, single)):
        for r in range(size):
            for name, value in outs_b[r].items():
                _same(value, outs_s[r][name], f"{spec} step {step} rank {r} {name}")
                _same(value, outs_b[0][name], f"replicas differ: step {step} {name}")
    for pb, ps in zip(pipes_b, pipes_s):
        for name in SHAPES:
            eb, es = pb.feedback.get(name), ps.feedback.get(name)
            assert (eb is None) == (es is None), name
            if eb is not None:
                _same(eb, es, f"residual of {name}")
            state_b, state_s = pb.scheme_state(name), ps.scheme_state(name)
            assert state_b.keys() == state_s.keys(), name
            for key in state_b:
                _same(state_b[key], state_s[key], f"state {key} of {name}")


@pytest.mark.parametrize("alternate", [False, True])
def test_one_collective_per_round_and_bucket(alternate: bool) -> None:
    """Past the warm-up a one-bucket step starts one collective per round (the dense
    tensors ride in the first), as the per-tensor path's fusion does; with one bucket per
    tensor, the batches are per bucket and the results unchanged."""
    spec = f"powersgd:rank=4,start_iter=1{',alternate=True' if alternate else ''}"
    outs, pipes, collectives = _run(spec, True, 2, 3)
    assert collectives == (1 if alternate else 2)
    assert pipes[0].last_step.collective_bytes["Q"] > 0  # step 2: alternate's left side
    assert pipes[0].last_step.compressed_tensors == 5
    per_bucket, _, many = _run(spec, True, 2, 3, bucket_bytes=1)
    assert many > collectives
    for a, b in zip(outs[-1], per_bucket[-1]):
        for name in a:
            _same(a[name], b[name], name)


def test_the_layout_groups_equal_shapes_and_cuts_views_of_one_buffer() -> None:
    keys = [(64, 4, True), (32, 4, False), (64, 4, True), (10, 2, True)]
    layout = FlatLayout.of(keys)
    assert [ix for _, ix in layout.groups] == [(0, 2), (1,), (3,)]
    assert layout.numel == 2 * 64 * 4 + 32 * 4 + 10 * 2
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    stored, blocks = layout.views(flat)
    assert [tuple(s.shape) for s in stored] == [(4, 64), (32, 4), (4, 64), (2, 10)]
    assert all(s.data_ptr() >= flat.data_ptr() for s in stored)
    stored[2].fill_(7.0)  # a view: writes land in the buffer
    assert torch.equal(flat[64 * 4:2 * 64 * 4], torch.full((256,), 7.0))
    factors = layout.factors(flat)
    assert [tuple(f.shape) for f in factors] == [(64, 4), (32, 4), (64, 4), (10, 2)]
    bases = layout.orthonormal(blocks)
    for factor, basis in zip(factors, bases):
        _same(basis, torch.linalg.qr(factor).Q, "batched QR differs from one QR")


def test_only_the_compressed_steps_are_batched() -> None:
    scheme = powersgd.PowerSGD(rank=4, start_iter=2)
    assert batches(scheme) and not batches(Compression.fp16())
    from hvd_compress.schemes.base import ExchangeContext
    x = torch.zeros(8, 8)
    assert not scheme.batches(x, {}, ExchangeContext("w", 0, 1, 1))
    assert scheme.batches(x, {}, ExchangeContext("w", 0, 1, 2))
    scheme.batch_tensors = False
    assert not scheme.batches(x, {}, ExchangeContext("w", 0, 1, 2))
    assert "batch" not in scheme.describe()
