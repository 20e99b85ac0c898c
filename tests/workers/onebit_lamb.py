"""1-bit LAMB on real ranks, side by side with LAMB written out by hand under Horovod's own
``hvd.DistributedOptimizer`` (gradients averaged by Horovod's all-reduce)."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from hvd_compress.torch import OneBitLamb
from tests import convergence_harness as harness

LR, DECAY = 1e-2, 0.01


class HandLamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, Algorithm 2) with Adam's bias corrections and decoupled weight
    decay, the trust ratio clamped to [0.01, 10]: the reference for the warm-up."""

    def __init__(self, params: Any, lr: float = LR, weight_decay: float = DECAY) -> None:
        # (Horovod's DistributedOptimizer constructs it again from its parameter groups.)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                t, m, v, g = state["t"], state["m"], state["v"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps)
                # The decay as OneBitLamb adds it, with `alpha`: ATen's vector kernels fuse
                # that multiply-add (one rounding), where `update + decay * p` rounds the
                # product first. The two differ in a few last bits per step, at elements
                # that depend on the CPU's vector width (AVX2 or AVX-512).
                update = update.add(p, alpha=group["weight_decay"])
                ratio = 1.0
                if p.norm() > 0 and update.norm() > 0:
                    ratio = min(max(float(p.norm()) / float(update.norm()), 0.01), 10.0)
                p.add_(update, alpha=-group["lr"] * ratio)


def side_by_side(models: list[torch.nn.Module], reference: torch.optim.Optimizer,
                 onebit: Any, steps: int, key: str) -> dict[str, Any]:
    """Step ``models[0]`` with ``reference`` and ``models[1]`` with ``onebit`` on the same
    digits batches (drawn from this rank's seed): both models' parameters after each step
    (under ``key`` and ``"onebit"``) and the last step's compression ratio."""
    x, y = harness.digits()[:2]
    order = torch.Generator().manual_seed(hvd.rank())
    out: dict[str, Any] = {key: [], "onebit": [], "ratio": 0.0}
    for _ in range(steps):
        idx = torch.randint(len(x), (32,), generator=order)
        for model, optimizer, name in ((models[0], reference, key),
                                       (models[1], onebit, "onebit")):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
            out[name].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    out["ratio"] = onebit.compression_stats.ratio
    return out


def against_lamb(freeze_step: int, steps: int) -> dict[str, Any]:
    """Two copies of the digits model from the same start, one stepped by
    ``hvd.DistributedOptimizer(HandLamb)``, one by ``OneBitLamb`` (:func:`side_by_side`)."""
    torch.set_num_threads(1)
    initial = harness.make_model().state_dict()
    models = [harness.make_model(), harness.make_model()]
    for model in models:
        model.load_state_dict(initial)
    lamb = hvd.DistributedOptimizer(HandLamb(models[0].parameters(), LR, DECAY),
                                    named_parameters=models[0].named_parameters())
    onebit = OneBitLamb(models[1].parameters(), lr=LR, weight_decay=DECAY,
                        freeze_step=freeze_step, named_parameters=models[1].named_parameters())
    return side_by_side(models, lamb, onebit, steps, "lamb")
