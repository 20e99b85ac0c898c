"""What the 1-bit Adam and 1-bit LAMB tests share: ranks of the digits model on threads,
their batches and steps, and the checks both optimizers must pass (exact resume in the
compressed stage, the warm-up equal to the uncompressed optimizer bit for bit)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hvd_compress.comm.threads import ThreadGroup
from tests import convergence_harness as harness
from tests.harness import kernel_env, run_ranks
from tests.threaded import on_threads

Ranks = tuple[list[torch.nn.Module], list[Any]]


@pytest.fixture(autouse=True)
def one_thread_per_rank() -> None:
    """One intra-op thread: the ranks are threads of one process, on shared cores."""
    torch.set_num_threads(1)


def ranks_of(factory: Callable[[torch.nn.Module, Any], Any], size: int = 2) -> Ranks:
    """``size`` copies of the digits model from one start, each with the optimizer
    ``factory(model, comm)`` on its rank of a new :class:`ThreadGroup`."""
    group = ThreadGroup(size, timeout=60)
    initial = harness.make_model().state_dict()
    models = [harness.make_model() for _ in range(size)]
    for model in models:
        model.load_state_dict(initial)
    return models, [factory(m, group.communicator(r)) for r, m in enumerate(models)]


def batches(step: int, size: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch of 32 digits per rank, drawn by a generator seeded with ``step``."""
    x, y = harness.digits()[:2]
    gen = torch.Generator().manual_seed(step)
    out = []
    for _ in range(size):
        idx = torch.randint(len(x), (32,), generator=gen)
        out.append((x[idx], y[idx]))
    return out


def step_all(optimizers: list[Any], models: list[torch.nn.Module],
             batch: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One training step on every rank at once (cross-entropy on its batch)."""
    def work(rank: int) -> None:
        x, y = batch[rank]
        optimizers[rank].zero_grad()
        torch.nn.functional.cross_entropy(models[rank](x), y).backward()
        optimizers[rank].step()
    on_threads(len(models), work)


def check_resume_mid_compression(make_ranks: Callable[[int], Ranks], label: str,
                                 option: str = "freeze_step", steps: int = 6,
                                 after: int = 1) -> None:
    """``steps`` steps (frozen after three), a checkpoint, ``after`` more steps; optimizers
    built anew from the checkpoint take the same steps bit for bit (parameters and
    optimizer state after each), and a checkpoint of another freeze step is refused naming
    it. ``make_ranks(freeze_step)``: a model and an optimizer per rank, from the same start;
    ``label``: the optimizer's class name; ``option``: its name for the freeze step."""
    models, optimizers = make_ranks(3)
    for step in range(steps):
        step_all(optimizers, models, batches(step))
    saved = [(copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict()))
             for m, o in zip(models, optimizers)]
    resumed_models, resumed = make_ranks(3)
    for model, opt, (model_state, opt_state) in zip(resumed_models, resumed, saved):
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        assert opt.frozen and opt.global_step == steps
    for step in range(steps, steps + after):
        step_all(optimizers, models, batches(step))
        step_all(resumed, resumed_models, batches(step))
        for a, b in zip(models, resumed_models):
            assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        for a, b in zip(optimizers, resumed):
            for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
                assert a.state[p].keys() == b.state[q].keys()
                for key, value in a.state[p].items():
                    other = b.state[q][key]
                    assert torch.equal(value, other) if torch.is_tensor(value) \
                        else value == other, (step, key)
    with pytest.raises(ValueError, match=f"{label}: the checkpoint was saved with "
                                         f"{option}=3"):
        make_ranks(4)[1][0].load_state_dict(saved[0][1])


def check_warmup_bit_for_bit(worker: str, reference: str, kernels: str, freeze: int = 20,
                             steps: int = 24) -> None:
    """``worker`` (``module:function`` of :mod:`tests.workers`) on 2 Gloo ranks returns, per
    rank, the parameters after every step of the 1-bit optimizer (``"onebit"``) and of the
    uncompressed one (``reference``), ``freeze_step=freeze``: they are equal bit for bit
    through the warm-up and different once compressed, the 1-bit ones are the same on every
    rank at every step, and the compressed stage sends more than 16x fewer bytes.

    The ranks run ``kernels`` (one of :func:`tests.harness.aten_kernels`, in ATen, MKL
    and oneDNN: :func:`tests.harness.kernel_env`): where the two sides compute with
    different operations (a multiply then an add against a fused multiply-add), which step
    first shows it depends on the vector width, and a warm-up of a few steps can hide it on
    one CPU and not on another."""
    ranks = run_ranks(worker, np=2, launcher="gloo", freeze_step=freeze, steps=steps,
                      env=kernel_env(kernels))
    for rank in ranks:
        for step in range(freeze):
            assert torch.equal(rank["onebit"][step], rank[reference][step]), step
        assert not torch.equal(rank["onebit"][-1], rank[reference][-1])  # compressed after
        assert rank["ratio"] > 16
    for step in range(steps):
        assert all(torch.equal(r["onebit"][step], ranks[0]["onebit"][step])
                   for r in ranks), step
