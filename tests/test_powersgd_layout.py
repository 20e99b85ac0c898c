"""PowerSGD's products in their transposed form (:func:`hvd_compress.schemes.powersgd.
_reduce_product`, ``Q`` kept as the transpose of a contiguous matrix): the same algorithm as
the textbook form, on both sides of the size threshold, at several ranks and ranks of
processes, and carried through a checkpoint."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression, Policy
from hvd_compress.schemes import powersgd
from hvd_compress.schemes.base import ExchangeContext
from tests.threaded import make_pipelines, on_threads

SHAPES = [(48, 20), (96, 256), (8, 3, 3, 3), (900, 600)]  # the last above TRANSPOSED_UP_TO


def reference_step(matrices: list[torch.Tensor], q: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Two-round PowerSGD written as the paper's Algorithm 1: (aggregate, next Q, each
    rank's new residual) for inputs ``matrices`` (``n x m``) and the shared ``Q``."""
    p = sum(m @ q for m in matrices)
    p_hat = torch.linalg.qr(p).Q
    q_locals = [m.t() @ p_hat for m in matrices]
    q_total = sum(q_locals)
    residuals = [m - p_hat @ ql.t() for m, ql in zip(matrices, q_locals)]
    return p_hat @ q_total.t(), q_total, residuals


def _close(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Equal up to float32 rounding of two orders of the same sums: the absolute slack is
    1e-5 of the reference's largest entry (at least 1e-5). The kept ``Q``'s entries reach
    about 15 at 900 x 600, where sums of 600 products rounded in another order (the
    transposed products, and another CPU's GEMM kernels) differ by up to 3e-5; a wrong
    product or factor is off by the entries' own size."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * scale, msg=msg)


def test_the_threshold_puts_shapes_on_both_sides() -> None:
    assert 900 * 600 > powersgd.TRANSPOSED_UP_TO >= 96 * 256


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("rank", [2, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_two_rounds_match_the_textbook_products(shape: tuple[int, ...], rank: int,
                                                size: int) -> None:
    """Three steps on ``size`` ranks: every aggregate, the kept ``Q`` and each rank's
    residual equal Algorithm 1's, computed with ``M Q`` and ``M^T P^`` as written."""
    scheme = Compression.powersgd(rank=rank, start_iter=0)
    pipes = make_pipelines(scheme, size, Policy(min_numel=1, min_compression_rate=0.1))
    gen = torch.Generator().manual_seed(rank * 10 + size)
    n = shape[0]
    m = torch.Size(shape).numel() // n
    residuals = [torch.zeros(n, m) for _ in range(size)]
    q = None
    for step in range(3):
        grads = [torch.randn(shape, generator=gen) for _ in range(size)]
        out = on_threads(size, lambda r, g=grads: pipes[r].reduce({"w": g[r]})["w"])
        if q is None:  # the first Q is the scheme's shared draw: take it from rank 0's run
            draw = ExchangeContext("w", 0, size, 0).generator("init-q", torch.device("cpu"),
                                                              shared=True)
            q = torch.randn(m, min(rank, n, m), generator=draw)
        inputs = [g.reshape(n, m) + e for g, e in zip(grads, residuals)]
        aggregate, q, residuals = reference_step(inputs, q)
        for r in range(size):
            _close(out[r].reshape(n, m), aggregate, f"step {step}, rank {r}: aggregate")
            _close(pipes[r].feedback.get("w").reshape(n, m), residuals[r],
                   f"step {step}, rank {r}: residual")
            kept = pipes[r].scheme_state("w")["q"]
            assert kept.shape == q.shape
            _close(kept, q, f"step {step}, rank {r}: kept Q")
        for other in out[1:]:
            assert torch.equal(other, out[0])  # identical replicas


@pytest.mark.parametrize("alternate", [False, True])
def test_a_checkpoint_continues_bit_for_bit(alternate: bool) -> None:
    """Q (and alternate's bases) kept as transposed views survive ``state_dict`` and
    ``load_state_dict``: the resumed pipeline's next steps are the uninterrupted one's,
    to the bit."""
    spec = f"powersgd:rank=4,start_iter=1{',alternate=True' if alternate else ''}"
    first, second = make_pipelines(Compression.parse(spec), 1)[0], None
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(64, 48, generator=gen) for _ in range(6)]
    for g in grads[:3]:
        first.reduce({"w": g})
    second = make_pipelines(Compression.parse(spec), 1)[0]
    second.load_state_dict(first.state_dict())
    for g in grads[3:]:
        assert torch.equal(first.reduce({"w": g})["w"], second.reduce({"w": g})["w"])
