"""1-bit Adam: plain Adam through the warm-up, then compressed momentum with error feedback
on both sides; identical ranks, exact resume, convergence like Adam on digits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.packed import CHUNK_RESIDUAL
from hvd_compress.torch import DistributedOptimizer, OneBitAdam
from tests import convergence_harness as harness
from tests.harness import aten_kernels
from tests.onebit_common import (
    batches,
    check_resume_mid_compression,
    check_warmup_bit_for_bit,
    ranks_of,
    step_all,
)
from tests.onebit_common import one_thread_per_rank as one_thread_per_rank  # autouse


def _onebit(freeze_step: int, **options: Any) -> Callable[..., OneBitAdam]:
    return lambda model, comm: OneBitAdam(model.parameters(), lr=1e-3,
                                          freeze_step=freeze_step, comm=comm,
                                          named_parameters=model.named_parameters(),
                                          **options)


def test_converges_like_adam_on_two_ranks() -> None:
    steps = 600
    adam = harness.train(Compression.none, lambda p: torch.optim.Adam(p, lr=1e-3),
                         steps=steps)[0]
    (run, optimizer), (other, _) = harness.train_exchanging(_onebit(100), steps=steps)
    assert torch.equal(run.params, other.params)
    assert run.accuracy > adam.accuracy - 1.0, (run.accuracy, adam.accuracy)
    assert run.final_loss < 2 * adam.final_loss + 0.02, (run.final_loss, adam.final_loss)
    stats = optimizer.compression_stats
    assert stats.compressed_tensors == 3 and stats.ratio > 16  # biases go dense
    weights = 4 * (64 * 128 + 128 * 128 + 128 * 10)
    assert stats.dense_bytes - 4 * (128 + 128 + 10) == weights


def _ranks(freeze_step: int) -> tuple[list[torch.nn.Module], list[OneBitAdam]]:
    return ranks_of(_onebit(freeze_step))


def test_error_feedback_accounting_after_the_freeze() -> None:
    """For every compressed tensor and step: what the ranks put in (their clipped momenta
    plus their old residuals) equals what came out (``size`` times the averaged momentum)
    plus what both sides kept back (new worker residuals, the change of the reducing
    ranks' residuals)."""
    models, optimizers = _ranks(freeze_step=3)
    for step in range(3):
        step_all(optimizers, models, batches(step))
    name = "2.weight"
    beta1, beta2 = 0.9, 0.999
    for step in range(3, 7):
        batch = batches(step)
        before = []
        for model, opt in zip(models, optimizers):
            state = opt.state[model[2].weight]
            pipe = opt._compressed
            residual = pipe.feedback.get(name)
            chunk = pipe.scheme_state(name).get(CHUNK_RESIDUAL)
            before.append((state["exp_avg"].clone(), state["exp_avg_sq"].clone(),
                           float(state["step"]),
                           torch.zeros(128, 128) if residual is None else residual.clone(),
                           None if chunk is None else chunk.clone()))
        grads = []
        for model, (x, y) in zip(models, batch):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append(model[2].weight.grad.clone())
        for model in models:
            model.zero_grad()
        step_all(optimizers, models, batch)
        inputs = torch.zeros(128, 128)
        for (m, v, _, e_old, _), g, opt in zip(before, grads, optimizers):
            d = (v / (1 - beta2 ** 3)).sqrt() + 1e-8
            u_local = ((beta1 * m + (1 - beta1) * g) / d).clamp(-3.1623, 3.1623)
            inputs += u_local + e_old - opt._compressed.feedback.get(name)
        kept_old = torch.cat([b[4] if b[4] is not None else torch.zeros(0) for b in before])
        kept_new = torch.cat([o._compressed.scheme_state(name)[CHUNK_RESIDUAL]
                              for o in optimizers])
        state = optimizers[0].state[models[0][2].weight]
        u_avg = state["exp_avg"] / ((before[0][1] / (1 - beta2 ** 3)).sqrt() + 1e-8)
        if kept_old.numel():
            inputs.view(-1).add_(kept_old)
        moving = before[0][1].view(-1) != 0  # a frozen v of 0 holds its element still
        assert moving.float().mean() > 0.5
        torch.testing.assert_close(inputs.view(-1)[moving],
                                   (2 * u_avg.view(-1) + kept_new)[moving],
                                   rtol=1e-4, atol=1e-4)  # float32 rounding
        assert not bool(state["exp_avg"].view(-1)[~moving].any())
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                      models[1].parameters()))


def test_resume_mid_compression_gives_the_same_next_step() -> None:
    check_resume_mid_compression(_ranks, "OneBitAdam")


def test_bad_options_are_refused_at_construction() -> None:
    params = list(harness.make_model().parameters())
    group = ThreadGroup(1)
    with pytest.raises(ValueError, match="amsgrad"):
        OneBitAdam(params, amsgrad=True, comm=group.communicator(0))
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdam(params, freeze_step=-1, comm=group.communicator(0))
    with pytest.raises(ValueError, match="error feedback"):
        OneBitAdam(params, compression=Compression.qsgd(), comm=group.communicator(0))
    # It exchanges by itself: wrapped, every step would exchange twice.
    with pytest.raises(TypeError, match="OneBitAdam averages across ranks by itself"):
        DistributedOptimizer(OneBitAdam(params, comm=group.communicator(0)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", aten_kernels())
def test_warmup_is_horovod_adam_bit_for_bit_on_two_ranks(kernels: str) -> None:
    check_warmup_bit_for_bit("tests.workers.onebit_adam:against_adam", "adam", kernels)
