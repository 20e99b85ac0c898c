"""0/1 Adam: variance updates at doubling spacings, 1-bit momentum between them, local
steps in rounds after the freeze; identical replicas at every sync, bytes by the schedule,
exact resume inside a round, convergence like Adam on digits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.packed import chunk_sizes
from hvd_compress.torch import OneBitAdam, ZeroOneAdam
from tests import convergence_harness as harness
from tests.harness import run_ranks
from tests.onebit_common import (
    batches,
    check_resume_mid_compression,
    ranks_of,
    step_all,
)
from tests.onebit_common import one_thread_per_rank as one_thread_per_rank  # autouse

# A schedule that shows every kind of step in a few steps: variance updates at steps 1, 2,
# 4, 6 and 10 (spacing 1, 1, 2, 2, 4; frozen after 10), then rounds of 1, 1, 1, 2, 2, 4, 4
# steps (the length doubles every 3 steps after the freeze, up to 4).
SMALL = {"var_freeze_step": 10, "var_update_scaler": 2, "local_step_scaler": 3,
         "local_step_clipper": 4}
KINDS = "VVCVCVCCCV" + "CCC" + "LC" "LC" "LLLC" "LLLC"
"""Step t's kind under SMALL: variance update (V), compressed (C: 1-bit, a sync after the
freeze), local (L: nothing sent)."""


def _zero_one(**options: Any) -> Callable[..., ZeroOneAdam]:
    return lambda model, comm: ZeroOneAdam(model.parameters(), lr=1e-3, comm=comm,
                                           named_parameters=model.named_parameters(),
                                           **options)


def test_variance_updates_space_out_by_doubling_and_rounds_grow_to_the_clipper() -> None:
    params = list(harness.make_model().parameters())
    comm = ThreadGroup(1).communicator(0)
    default = ZeroOneAdam(params, var_freeze_step=1000, comm=comm)
    expected = [*range(1, 17), *range(18, 49, 2), *range(52, 113, 4), *range(120, 241, 8)]
    assert [t for t in range(1, 241) if default.is_variance_step(t)] == expected
    assert [default.round_length(k) for k in (0, 32677, 32678, 65356, 4 * 32678, 10 ** 9)] \
        == [1, 1, 2, 4, 16, 16]
    small = ZeroOneAdam(params, comm=comm, **SMALL)
    assert [t for t in range(1, 40) if small.is_variance_step(t)] == \
        [t + 1 for t, kind in enumerate(KINDS) if kind == "V"]
    assert [small.round_length(k) for k in range(10)] == [1, 1, 1, 2, 2, 2, 4, 4, 4, 4]


def test_every_step_a_variance_update_then_rounds_of_one_step_is_onebit_adam() -> None:
    """With ``var_update_scaler >= var_freeze_step`` every step up to the freeze updates the
    variance (plain Adam on averaged gradients) and with ``local_step_clipper=1`` every
    later step is a compressed one: 1-bit Adam, bit for bit, and the same bytes."""
    zero_models, zero_one = ranks_of(_zero_one(var_freeze_step=5, var_update_scaler=5,
                                                         local_step_clipper=1))
    models, onebit = ranks_of(lambda model, comm: OneBitAdam(
        model.parameters(), lr=1e-3, freeze_step=5, comm=comm,
        named_parameters=model.named_parameters()))
    for step in range(12):
        step_all(zero_one, zero_models, batches(step))
        step_all(onebit, models, batches(step))
        for a, b in zip(zero_models, models):
            assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), step
        assert zero_one[0].compression_stats.payload_bytes == \
            onebit[0].compression_stats.payload_bytes, step
    assert zero_one[0].compression_stats.ratio > 16


def test_local_steps_move_each_rank_and_the_sync_restarts_from_the_rounds_start() -> None:
    """Inside a round each rank steps by ``gamma_t * m / d`` with its own momentum (the
    replicas part); the sync sets every rank to the round's start minus the sum of the
    round's ``gamma_t`` times the averaged momentum in the preconditioner's units (the
    replicas agree bit for bit again), and the momentum to that average times ``d``."""
    models, optimizers = ranks_of(_zero_one(**SMALL))
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    v_updates = KINDS[:10].count("V")
    start: list[torch.Tensor] = []
    total = 0.0
    for step, kind in enumerate(KINDS):
        before = [m[2].weight.detach().clone() for m in models]
        step_all(optimizers, models, batches(step))
        same = all(torch.equal(p, q) for p, q in zip(models[0].parameters(),
                                                      models[1].parameters()))
        assert same == (kind != "L"), (step, kind)
        if step + 1 < len(KINDS):
            assert optimizers[0].syncs == (KINDS[step + 1] != "L"), step
        if step < 10:
            continue
        gamma = 1e-3 / (1 - beta1 ** (step + 1))
        if not start:
            start, total = before, 0.0
        total += gamma
        for model, opt, origin, previous in zip(models, optimizers, start, before):
            state = opt.state[model[2].weight]
            d = (state["exp_avg_sq"] / (1 - beta2 ** v_updates)).sqrt() + eps
            p = model[2].weight.detach()
            if kind == "L":
                torch.testing.assert_close(p, previous - gamma * state["exp_avg"] / d,
                                           rtol=0, atol=1e-6)
            else:
                torch.testing.assert_close(p, origin - total * state["exp_avg"] / d,
                                           rtol=0, atol=1e-6)
                assert "anchor" not in state and "round_mean" not in state
        if kind == "C":
            start = []


@pytest.mark.multiprocess
def test_bytes_per_step_follow_the_schedule_and_replicas_agree_at_every_sync() -> None:
    """On 2 Gloo ranks: variance updates send every gradient as float32, compressed steps
    and syncs the 1-bit momentum (exact size from the wire format), local steps nothing;
    the ranks' parameters are bit-identical after every step but the local ones."""
    ranks = run_ranks("tests.workers.zero_one_adam:per_step", np=2, launcher="gloo",
                      steps=len(KINDS), **SMALL)
    model = harness.make_model()
    dense = sum(4 * p.numel() for p in model.parameters())
    codec = Compression.onebit()
    onebit = sum(sum(codec.chunk_bytes(n) for n in chunk_sizes(p.numel(), 2, 2048))
                 if p.dim() >= 2 and p.numel() >= 1024 else 4 * p.numel()
                 for p in model.parameters())
    assert dense / onebit > 16
    for rank in ranks:
        for step, kind in enumerate(KINDS):
            expected = {"V": dense, "C": onebit, "L": 0}[kind]
            assert rank["payload"][step] == expected, (step, kind)
            assert rank["dense"][step] == dense
            assert (rank["collectives"][step] == 0) == (kind == "L"), (step, kind)
            assert rank["syncs"][step] == (kind != "L"), (step, kind)
    for step, kind in enumerate(KINDS):
        same = torch.equal(ranks[0]["params"][step], ranks[1]["params"][step])
        assert same == (kind != "L"), (step, kind)


def _ranks(freeze_step: int) -> tuple[list[torch.nn.Module], list[ZeroOneAdam]]:
    # Rounds after the freeze at 3: steps [3], [4], [5, 6], [7, 8, 9, 10] (0-based).
    return ranks_of(_zero_one(var_freeze_step=freeze_step, var_update_scaler=1,
                              local_step_scaler=2, local_step_clipper=4))


def test_resume_inside_a_round_gives_the_same_steps_through_the_sync() -> None:
    models, optimizers = _ranks(3)
    for step in range(8):
        step_all(optimizers, models, batches(step))
    assert optimizers[0].round_end == 10 and "anchor" in optimizers[0].state[
        models[0][2].weight]  # step 8 is inside a round
    check_resume_mid_compression(_ranks, "ZeroOneAdam", option="var_freeze_step", steps=8,
                                 after=3)
    other = ranks_of(_zero_one(var_freeze_step=3, var_update_scaler=1, local_step_scaler=3,
                               local_step_clipper=4))[1][0]
    with pytest.raises(ValueError, match="saved with local_step_scaler=2 but this optimizer "
                                         "has local_step_scaler=3"):
        other.load_state_dict(optimizers[0].state_dict())


def test_converges_like_adam_on_two_ranks() -> None:
    steps = 600
    adam = harness.train(Compression.none, lambda p: torch.optim.Adam(p, lr=1e-3),
                         steps=steps)[0]
    # Rounds of 1, 2, 4 steps, then of 8 from step 272 on; the last one ends at step 599.
    (run, optimizer), (other, _) = harness.train_exchanging(
        _zero_one(var_freeze_step=120, local_step_scaler=50, local_step_clipper=8),
        steps=steps)
    assert optimizer.round_end == steps - 1
    assert torch.equal(run.params, other.params)
    assert run.accuracy > adam.accuracy - 1.0, (run.accuracy, adam.accuracy)
    assert run.final_loss < 2 * adam.final_loss + 0.02, (run.final_loss, adam.final_loss)


def test_bad_arguments_are_refused_at_construction() -> None:
    model = harness.make_model()
    params = list(model.parameters())
    comm = ThreadGroup(1).communicator(0)
    for option, value in (("var_freeze_step", 0), ("var_freeze_step", 2.5),
                          ("var_update_scaler", 0), ("local_step_scaler", -1),
                          ("local_step_clipper", 0), ("local_step_clipper", True)):
        with pytest.raises(ValueError, match=f"ZeroOneAdam: {option} must be an integer "
                                             f">= 1, got {value!r}"):
            ZeroOneAdam(params, comm=comm, **{option: value})
    with pytest.raises(ValueError, match="ZeroOneAdam does not support amsgrad"):
        ZeroOneAdam(params, amsgrad=True, comm=comm)
    with pytest.raises(ValueError, match="error feedback"):
        ZeroOneAdam(params, compression=Compression.qsgd(), comm=comm)
    with pytest.raises(ValueError, match="lacks 1 optimised parameter"):
        ZeroOneAdam(params, comm=comm, named_parameters=list(model.named_parameters())[1:])
