"""1-bit LAMB: LAMB by hand through the warm-up, then 1-bit Adam's compressed momentum with
LAMB's frozen, rescaled trust ratios; identical ranks, exact resume, convergence."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.torch import OneBitLamb
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

LR, DECAY = 1e-2, 0.01


def _onebit(freeze_step: int, **options: Any) -> Callable[..., OneBitLamb]:
    return lambda model, comm: OneBitLamb(model.parameters(), lr=LR, weight_decay=DECAY,
                                          freeze_step=freeze_step, comm=comm,
                                          named_parameters=model.named_parameters(),
                                          **options)


def _ranks(freeze_step: int) -> tuple[list[torch.nn.Module], list[OneBitLamb]]:
    return ranks_of(_onebit(freeze_step))


def test_compressed_steps_follow_the_frozen_and_rescaled_trust_ratio() -> None:
    """After the freeze, for every tensor and step: the momentum is the averaged ``u``
    times the frozen preconditioner, the fresh variance takes the gradient the momenta
    imply, the factor is the fresh variance's bound kept within its limits, and the
    parameter moves by ``lr * c_frozen * f * (u / (1 - beta1^t) + decay * p)``."""
    freeze = 4
    models, optimizers = _ranks(freeze_step=freeze)
    for step in range(freeze):
        step_all(optimizers, models, batches(step))
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    p = models[0][2].weight
    state = optimizers[0].state[p]
    c_frozen = state["coeff_frozen"]
    assert 0.01 <= c_frozen <= 10
    factors = []
    for step in range(freeze, freeze + 6):
        m_old, v = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        fresh_old = state.get("exp_avg_sq_fresh", v).clone()
        last = state.get("factor", 1.0)
        p_old = p.detach().clone()
        step_all(optimizers, models, batches(step))
        t = float(state["step"])
        assert t == step + 1 and state["coeff_frozen"] == c_frozen  # frozen
        assert torch.equal(state["exp_avg_sq"], v)  # the variance too
        d = (v / (1 - beta2 ** freeze)).sqrt() + eps
        u = state["exp_avg"] / d
        implied = (state["exp_avg"] - beta1 * m_old) / (1 - beta1)
        fresh = beta2 * fresh_old + (1 - beta2) * implied * implied
        torch.testing.assert_close(state["exp_avg_sq_fresh"], fresh, rtol=1e-5, atol=1e-12)
        plain = u / (1 - beta1 ** t)
        update = plain + DECAY * p_old
        factor = float((d / ((fresh / (1 - beta2 ** t)).sqrt() + eps)).max())
        share = min(1.0, float(plain.norm() / update.norm()))
        factor = min(max(factor * share + 1 - share, 0.5), 4.0)
        factor = min(max(factor, 0.9 * last), 1.1 * last)
        assert state["factor"] == pytest.approx(factor, rel=1e-4)
        factors.append(state["factor"])
        torch.testing.assert_close(p.detach(), p_old - LR * c_frozen * state["factor"] * update,
                                   rtol=1e-5, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                      models[1].parameters()))
    assert len(set(factors)) > 1  # the scaling moves from step to step


def test_resume_mid_compression_gives_the_same_next_step() -> None:
    check_resume_mid_compression(lambda freeze: _ranks(freeze_step=freeze), "OneBitLamb")


def test_converges_like_lamb_on_two_ranks() -> None:
    """600 steps on digits, lr 1e-2, decay 0.01: 1-bit LAMB frozen after 100 steps against
    the same optimizer never frozen (plain LAMB on averaged gradients)."""
    steps = 600
    (lamb, _), _ = harness.train_exchanging(_onebit(steps + 1), steps=steps)
    (run, optimizer), (other, _) = harness.train_exchanging(_onebit(100), steps=steps)
    assert torch.equal(run.params, other.params)
    assert lamb.accuracy > 94, lamb.accuracy
    assert run.accuracy > lamb.accuracy - 1.0, (run.accuracy, lamb.accuracy)
    assert run.final_loss < 2 * lamb.final_loss + 0.02, (run.final_loss, lamb.final_loss)
    stats = optimizer.compression_stats
    assert stats.compressed_tensors == 3 and stats.ratio > 16  # biases go dense


def test_bad_options_are_refused_at_construction() -> None:
    model = harness.make_model()
    params = list(model.parameters())
    comm = ThreadGroup(1).communicator(0)
    for options, message in (({"freeze_step": -1}, "freeze_step"),
                             ({"betas": (0.9, 1.0)}, "betas"),
                             ({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff <= max_coeff"),
                             ({"factor_min": 1.5}, "factor_min <= 1 <= factor_max"),
                             ({"factor_threshold": 1.0}, "factor_threshold"),
                             ({"coeff_beta": 1.0}, "coeff_beta"),
                             ({"lr": 0.0}, "lr must be a positive number"),
                             ({"compression": Compression.qsgd()}, "error feedback")):
        with pytest.raises(ValueError, match=message):
            OneBitLamb(params, comm=comm, **options)
    named = list(model.named_parameters())[:2]
    with pytest.raises(ValueError, match="OneBitLamb: named_parameters lacks 4"):
        OneBitLamb(params, comm=comm, named_parameters=named)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", aten_kernels())
def test_warmup_is_horovod_averaged_lamb_bit_for_bit_on_two_ranks(kernels: str) -> None:
    check_warmup_bit_for_bit("tests.workers.onebit_lamb:against_lamb", "lamb", kernels)
