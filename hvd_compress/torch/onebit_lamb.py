"""``OneBitLamb``: LAMB whose momentum, not its gradient, is exchanged with 1-bit compression.

1-bit LAMB (Li et al. 2022, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
Training with LAMB's Convergence Speed", HiPC; DeepSpeed's ``OnebitLamb``) carries 1-bit
Adam's two stages over to LAMB (You et al. 2020, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes"), whose step is Adam's, rescaled per tensor by a
trust ratio. The momentum exchange is :class:`~hvd_compress.torch.OneBitAdam`'s, the same
code (:class:`~hvd_compress.torch.onebit_adam.OneBitMomentum`); what differs is the update.

1. **Warm-up** (the first ``freeze_step`` steps): plain LAMB on gradients averaged over all
   ranks by an uncompressed all-reduce. Per tensor, with Adam's moments and bias
   corrections::

       m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2
       r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
       update = r + weight_decay * p                     (decoupled weight decay)
       c = clamp(||p|| / ||update||, min_coeff, max_coeff)   (1 if either norm is 0)
       p -= lr * c * update

   and each tensor keeps ``c_frozen``, the exponential moving average of its ``c`` with
   weight ``coeff_beta`` on the past (started at the first ``c``).
2. **Compression** (every later step): ``v`` is frozen; each rank updates the momentum with
   its local gradient, and the ranks exchange ``clip(m / d)`` (``d = sqrt(v / (1 -
   beta2^freeze)) + eps``) by the compressed all-reduce with error feedback on both sides,
   exactly as 1-bit Adam does (its module docstring gives the reasons for the units, the
   clip and the mask of elements with ``v = 0``). From the averaged ``u``, ``m = u * d``.
   The trust ratio of a frozen ``v`` would go stale, so, as in the paper's Algorithm 1,
   it stays ``c_frozen`` scaled by how much the variance would have moved: a *fresh*
   variance is kept from the gradients the momenta imply, ``g~ = (m - beta1 * m_old) /
   (1 - beta1)``::

       v_fresh = beta2 * v_fresh + (1 - beta2) * g~^2       (v_fresh = v at the freeze)
       r = u / (1 - beta1^t);   update = r + weight_decay * p
       f = max over elements of d / (sqrt(v_fresh / (1 - beta2^t)) + eps)
       f = f * q + (1 - q),  q = min(1, ||r|| / ||update||)   (with weight decay only)
       f = clamp(f, factor_min, factor_max), then within (1 +- factor_threshold) of the
           previous step's f (1 before the first compressed step)
       p -= lr * c_frozen * f * update

   Every rank ends with the same ``m`` and the same ``f``, so parameters stay identical
   without a broadcast; the wire carries what 1-bit Adam's does (1 bit per element plus
   one float32 scale per 2048 elements).

Unlike DeepSpeed's ``OnebitLamb``, Adam's bias corrections are kept (the update is
continuous at ``freeze_step``), ``c_frozen`` starts at the first trust ratio instead of 0,
and the momentum is compressed tensor by tensor in the frozen preconditioner's units with
1-bit Adam's clip and mask; DeepSpeed's defaults are kept for every coefficient.

Call ``loss.backward()`` then ``optimizer.step()`` on every rank, with the same parameters
in the same order. ``state_dict()`` holds the moments, the fresh variance, ``c_frozen``
and ``f`` per tensor plus the compression state (both residuals, step counters), so a
checkpoint taken mid-compression resumes to the same next step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.policy import Policy
from hvd_compress.schemes.base import Scheme
from hvd_compress.torch.onebit_adam import OneBitMomentum

STATE_KEY = "hvd_compress_onebit_lamb"


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"OneBitLamb: {name} must be a positive number, got {value!r}")
    return float(value)


class OneBitLamb(OneBitMomentum):
    """LAMB with 1-bit compressed momentum after a warm-up (see the module docstring).

    Args:
        params: the parameters (or parameter groups), as for any ``torch.optim`` optimizer.
        lr: the learning rate (default 1e-3).
        betas: Adam's moment coefficients (default ``(0.9, 0.999)``).
        eps: Adam's denominator term (default 1e-8).
        weight_decay: LAMB's decoupled weight decay, added to the update before its trust
            ratio. Default 0.
        max_coeff: the upper bound of the trust ratio ``c`` (default 10, DeepSpeed's).
        min_coeff: the lower bound of the trust ratio ``c`` (default 0.01, DeepSpeed's).
        coeff_beta: the weight of the past in ``c_frozen``, the moving average of the
            warm-up's trust ratios. Default 0.9.
        factor_max: the upper bound of the compression stage's scaling ``f`` of
            ``c_frozen`` (default 4).
        factor_min: the lower bound of ``f`` (default 0.5).
        factor_threshold: the most ``f`` may change from one step to the next, relatively.
            Default 0.1.
        freeze_step: warm-up steps of plain LAMB with uncompressed gradients. Default
            100000 (DeepSpeed's); the paper freezes after about 15-25% of the steps.

    ``named_parameters``, ``compression``, ``policy``, ``comm`` and ``seed`` are as for
    :class:`~hvd_compress.torch.OneBitAdam` (default names ``onebit_lamb.<group>.<index>``).

    Raises ``ValueError`` at construction for an option out of range, a compression scheme
    without error feedback, and duplicated or missing parameter names.
    """

    state_key = STATE_KEY
    decay_in_gradient = False

    def __init__(self, params: Any, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, *, freeze_step: int = 100_000,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Scheme | None = None, policy: Policy | None = None,
                 comm: Communicator | None = None, seed: int = 0) -> None:
        self._check_freeze_step(freeze_step)
        _positive("lr", lr)
        _positive("eps", eps)
        if not all(0 <= b < 1 for b in betas) or len(betas) != 2:
            raise ValueError(f"OneBitLamb: betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0:
            raise ValueError(f"OneBitLamb: weight_decay must be >= 0, got {weight_decay}")
        if not 0 < _positive("min_coeff", min_coeff) <= _positive("max_coeff", max_coeff):
            raise ValueError(f"OneBitLamb: need min_coeff <= max_coeff, got {min_coeff} and "
                             f"{max_coeff}")
        if not 0 <= coeff_beta < 1:
            raise ValueError(f"OneBitLamb: coeff_beta must be in [0, 1), got {coeff_beta}")
        if not 0 < _positive("factor_min", factor_min) <= 1 <= _positive("factor_max",
                                                                         factor_max):
            raise ValueError(f"OneBitLamb: need factor_min <= 1 <= factor_max, got "
                             f"{factor_min} and {factor_max}")
        if not 0 <= factor_threshold < 1:
            raise ValueError(f"OneBitLamb: factor_threshold must be in [0, 1), got "
                             f"{factor_threshold}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps,
                    "weight_decay": weight_decay, "max_coeff": max_coeff,
                    "min_coeff": min_coeff, "coeff_beta": coeff_beta,
                    "factor_max": factor_max, "factor_min": factor_min,
                    "factor_threshold": factor_threshold}
        torch.optim.Optimizer.__init__(self, params, defaults)
        self._setup(freeze_step, named_parameters, compression, policy, comm, seed)

    @staticmethod
    def trust_ratio(p: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> float:
        """LAMB's ``clamp(||p|| / ||update||, min_coeff, max_coeff)``; 1 if a norm is 0."""
        weight_norm = float(torch.linalg.vector_norm(p))
        update_norm = float(torch.linalg.vector_norm(update))
        if weight_norm == 0 or update_norm == 0:
            return 1.0
        return min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])

    def _warmup_update(self) -> None:
        for group, p, state in self._trained():
            beta1, beta2 = group["betas"]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = float(state["step"])
            grad = p.grad
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
            update = (state["exp_avg"] / (1 - beta1 ** t)).div_(denom)
            if group["weight_decay"]:
                update.add_(p, alpha=group["weight_decay"])
            coeff = self.trust_ratio(p, update, group)
            previous = state.get("coeff_frozen")
            state["coeff_frozen"] = coeff if previous is None else (
                group["coeff_beta"] * previous + (1 - group["coeff_beta"]) * coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def _apply_momentum(self, p: torch.Tensor, u: torch.Tensor, state: dict[str, Any],
                        group: dict[str, Any], denom: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        if "exp_avg_sq_fresh" not in state:  # the first compressed step
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            state["factor"] = 1.0
        momentum = u * denom
        # The averaged gradient the new momentum implies, into the fresh variance.
        implied = torch.sub(momentum, state["exp_avg"], alpha=beta1).div_(1 - beta1)
        fresh = state["exp_avg_sq_fresh"]
        fresh.mul_(beta2).addcmul_(implied, implied, value=1 - beta2)
        state["exp_avg"].copy_(momentum)
        state["step"] += 1
        t = float(state["step"])
        update = u / (1 - beta1 ** t)
        fresh_denom = (fresh / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
        factor = float((denom / fresh_denom).max())
        if group["weight_decay"]:
            plain_norm = float(torch.linalg.vector_norm(update))
            update.add_(p, alpha=group["weight_decay"])
            update_norm = float(torch.linalg.vector_norm(update))
            share = min(1.0, plain_norm / update_norm) if update_norm > 0 else 1.0
            factor = factor * share + (1 - share)
        factor = min(max(factor, group["factor_min"]), group["factor_max"])
        last = state["factor"]
        factor = min(max(factor, last * (1 - group["factor_threshold"])),
                     last * (1 + group["factor_threshold"]))
        state["factor"] = factor
        p.add_(update, alpha=-group["lr"] * state["coeff_frozen"] * factor)
