"""``ZeroOneAdam``: 1-bit Adam without its long uncompressed warm-up, and with skipped rounds.

0/1 Adam (Lu, Li, Zhang, De Sa and He, "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", ICLR 2023, arXiv:2202.06009; DeepSpeed's ``ZeroOneAdam``) keeps
1-bit Adam's idea (:mod:`hvd_compress.torch.onebit_adam`: with a variance that every rank
agrees on, Adam's step is linear in the momentum, so the momentum can travel 1-bit
compressed with error feedback) and removes its two costs: the full-precision warm-up
before the variance is frozen, and one exchange per step after it. A step ``t`` (counted
from 1) is one of three kinds:

1. **Variance update** (``t`` in ``T_v``, ``t <= var_freeze_step``): the gradients are
   averaged over the ranks by an uncompressed all-reduce and both moments take the
   average, an ordinary Adam step (with ``v``'s bias correction counted in variance
   updates, ``n_v``, since ``v`` only moves at these steps)::

       m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2;   n_v += 1
       p -= lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^n_v)) + eps)

   ``T_v`` is the paper's adaptive freezing policy: the variance is updated at steps
   1, 2, ..., ``var_update_scaler`` (spacing 1), then ``var_update_scaler`` times with
   spacing 2, then with spacing 4, and so on, the spacing doubling after every
   ``var_update_scaler`` updates; with the default 16: steps 1-16, 18, 20, ..., 48,
   52, ..., 112, 120, ...  After ``var_freeze_step`` it never changes again.
2. **Compressed step** (every other step up to ``var_freeze_step``, and the last step of
   each round after it): 1-bit Adam's compressed step with the current, stale ``v``
   (:class:`~hvd_compress.torch.onebit_adam.OneBitMomentum`). Each rank updates the
   momentum with its own gradient and the ranks average ``u = clip(m / d, -B, B)``,
   ``d = sqrt(v / (1 - beta2^n_v)) + eps``, by the compressed all-reduce with error
   feedback on the worker and on the reducing side; then ``m = u * d`` and
   ``p -= lr / (1 - beta1^t) * u``. The momentum travels in the preconditioner's units
   (1-bit Adam's module docstring gives why, and why the clip to Adam's bound ``B``), so
   the error-feedback residuals keep their meaning across kinds and need no reset at
   ``var_freeze_step`` (DeepSpeed clears its residuals there, because it compresses the
   gradient before and an accumulated momentum after).
3. **Local step** (after ``var_freeze_step``, every step of a round but its last): nothing
   is sent. Each rank updates its momentum with its own gradient and moves its own
   parameters by ``gamma_t * u_local`` (``gamma_t = lr / (1 - beta1^t)``), keeping the
   round's ``gamma``-weighted mean of its ``u_local``. The round's last step sends that
   mean (its own ``u_local`` included) through the compressed all-reduce, and every rank
   restarts from the parameters it had at the round's start::

       p = p_round_start - (sum of the round's gamma_t) * mean over ranks of the round's mean
       m = that mean * d

   which is the paper's 1-bit synchronisation (``theta = theta_t' - u_bar / (sqrt(v) +
   eps)``, ``m = u_bar / sum of the learning rates``) in the preconditioner's units. A
   round after ``var_freeze_step`` that starts ``k`` steps after it lasts
   ``min(local_step_clipper, 2^floor(k / local_step_scaler))`` steps: one step per round
   (no local steps) for the first ``local_step_scaler`` steps, then rounds of 2, 4, ...,
   up to ``local_step_clipper`` (the paper's ``H``). A round of one step is exactly a
   compressed step.

**Invariant.** Every rank holds bit-identical parameters and momenta after every step up
to ``var_freeze_step`` and, after it, after every step that ends a round (the sync);
inside a round each rank's parameters and momentum follow its own gradients. Checkpoint at
a sync step to get one model for all ranks; a checkpoint anywhere (inside a round too)
resumes each rank to the same next steps bit for bit: ``state_dict()`` holds Adam's
state, the round in progress (its start, its mean and its sum of step sizes per
parameter, and its last step) and the compressed exchange's residuals.

Unlike DeepSpeed's ``ZeroOneAdam``, Adam's bias corrections are kept, the momentum (not
the gradient) is what every compressed exchange sends, in the preconditioner's units with
1-bit Adam's clip and mask, the spacing of ``T_v`` doubles exactly and a round's length is
fixed when it starts; the defaults are DeepSpeed's.

Costs: variance-update steps send float32 (``4 n`` bytes per ``n`` elements), compressed
steps and syncs what ``compression`` sends for the tensors the policy compresses (the
others' momentum is averaged exactly), local steps nothing. Inside a round each parameter
keeps two more tensors of its size (the round's start and the mean), freed at the sync.
Call ``loss.backward()`` then ``optimizer.step()`` on every rank, with the same parameters
in the same order; the learning rate may change from step to step, alike on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.pipeline import StepStats
from hvd_compress.policy import Policy
from hvd_compress.schemes.base import Scheme
from hvd_compress.torch.onebit_adam import OneBitAdam

STATE_KEY = "hvd_compress_zero_one_adam"
SCHEDULE_OPTIONS = ("var_update_scaler", "local_step_scaler", "local_step_clipper")


def variance_updates(t: int, scaler: int) -> int:
    """How many of the steps ``1..t`` are in ``T_v`` when the spacing of variance updates
    starts at 1 and doubles after every ``scaler`` updates (with no freeze)."""
    count, start, spacing = 0, 0, 1
    while t > start + scaler * spacing:  # past this spacing's `scaler` updates
        count += scaler
        start += scaler * spacing
        spacing *= 2
    return count + max(t - start, 0) // spacing


def _count(name: str, value: int, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"ZeroOneAdam: {name} must be an integer >= {least}, got {value!r}")
    return value


class ZeroOneAdam(OneBitAdam):
    """Adam with adaptive variance freezing, 1-bit compressed momentum and local steps
    (0/1 Adam; see the module docstring for the algorithm).

    Args:
        params: the parameters (or parameter groups), as for ``torch.optim.Adam``.
        lr: Adam's learning rate (default 1e-3).
        betas: Adam's moment coefficients (default ``(0.9, 0.999)``).
        eps: Adam's denominator term (default 1e-8).
        weight_decay: Adam's L2 term, added to the gradient (default 0).
        var_freeze_step: the last step at which the variance may be updated; after it the
            variance is frozen and local steps begin. Default 100000 (DeepSpeed's); the
            paper puts it at the end of the learning-rate warm-up.
        var_update_scaler: variance updates at each spacing before the spacing doubles
            (the paper's ``kappa``). Default 16.
        local_step_scaler: steps after ``var_freeze_step`` between doublings of the round
            length. Default 32678 (DeepSpeed's value, as it ships).
        local_step_clipper: the longest round, in steps (the paper's ``H``). Default 16;
            1 turns local steps off (every step after the freeze is a compressed step).

    ``named_parameters``, ``compression``, ``policy``, ``comm`` and ``seed`` are as for
    :class:`~hvd_compress.torch.OneBitAdam` (default names ``zero_one_adam.<group>.<index>``).

    Raises ``ValueError`` at construction for a schedule option that is not a positive
    integer, for Adam options 0/1 Adam does not support (``amsgrad``, ``maximize``, a
    capturable or differentiable Adam), for a compression scheme without error feedback,
    and for duplicated or missing parameter names.
    """

    state_key = STATE_KEY
    freeze_option = "var_freeze_step"

    def __init__(self, params: Any, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, var_freeze_step: int = 100_000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Scheme | None = None, policy: Policy | None = None,
                 comm: Communicator | None = None, seed: int = 0, **adam_options: Any) -> None:
        _count("var_freeze_step", var_freeze_step, 1)  # step 1 sets the first variance
        self.var_update_scaler = _count("var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = _count("local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = _count("local_step_clipper", local_step_clipper, 1)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         freeze_step=var_freeze_step, named_parameters=named_parameters,
                         compression=compression, policy=policy, comm=comm, seed=seed,
                         **adam_options)
        self.round_end: int | None = None
        """The (0-based) step that ends the round in progress after the freeze."""
        self._last_kind = "variance"
        self._skipped = StepStats()

    # Schedules ---------------------------------------------------------------------------
    def _variance_count(self, t: int) -> int:
        """``n_v`` after step ``t``: the variance updates among steps ``1..t``."""
        return variance_updates(min(t, self.freeze_step), self.var_update_scaler)

    def is_variance_step(self, t: int) -> bool:
        """Whether step ``t`` (counted from 1) updates the variance (is in ``T_v``)."""
        return self._variance_count(t) > self._variance_count(t - 1)

    def round_length(self, k: int) -> int:
        """Steps of a round that starts ``k`` steps after ``var_freeze_step``."""
        doublings = k // self.local_step_scaler
        if doublings >= self.local_step_clipper.bit_length():
            return self.local_step_clipper
        return min(self.local_step_clipper, 1 << doublings)

    @property
    def syncs(self) -> bool:
        """Whether the next step exchanges anything (it is not a local step)."""
        step = self.global_step
        if not self.frozen:
            return True
        if self.round_end is not None and step <= self.round_end:
            return step == self.round_end
        return self.round_length(step - self.freeze_step) == 1

    def _exchanges_gradients(self) -> bool:
        return self.is_variance_step(self.global_step + 1)

    # Steps -------------------------------------------------------------------------------
    def _warmup_update(self) -> None:
        """Adam on the averaged gradients, ``v``'s bias correction by variance updates
        (the same operations as ``torch.optim.Adam``'s single-tensor step, so while every
        step is a variance update it is Adam bit for bit)."""
        self._last_kind = "variance"
        updates = float(self._variance_count(self.global_step + 1))
        for group, p, state in self._adam_moments():
            beta1, beta2 = group["betas"]
            state["step"] += 1
            grad = p.grad
            if group["weight_decay"]:
                grad = grad.add(p, alpha=group["weight_decay"])
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step_size = group["lr"] / (1 - beta1 ** float(state["step"]))
            denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** updates) ** 0.5)
            p.addcdiv_(state["exp_avg"], denom.add_(group["eps"]), value=-step_size)

    def _denominator(self, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        updates = float(self._variance_count(self.global_step + 1))
        denom = (state["exp_avg_sq"] / (1 - group["betas"][1] ** updates)).sqrt_()
        return denom.add_(group["eps"])

    def _compressed_step(self) -> None:
        if not self.frozen:
            self._last_kind = "compressed"
            super()._compressed_step()
            return
        step = self.global_step
        if self.round_end is None or step > self.round_end:
            self.round_end = step + self.round_length(step - self.freeze_step) - 1
        sync = step == self.round_end
        local, owners = self._local_momenta()
        means: dict[str, torch.Tensor] = {}
        totals: dict[str, float] = {}
        for name, u in local.items():
            p, state, group, denom = owners[name]
            step_size = group["lr"] / (1 - group["betas"][0] ** (float(state["step"]) + 1))
            total = state.pop("round_lr", 0.0) + step_size
            mean = state.pop("round_mean", None)
            if mean is None:  # the round's first step
                mean = u if sync else u.clone()
            else:
                mean.add_(u - mean, alpha=step_size / total)
            if sync:
                means[name], totals[name] = mean, total
                continue
            if "anchor" not in state:
                state["anchor"] = p.detach().clone()
            p.add_(self._hold_unseen(u, state), alpha=-step_size)
            state["exp_avg"].copy_(u).mul_(denom)
            state["step"] += 1
            state["round_mean"], state["round_lr"] = mean, total
        if not sync:
            self._last_kind = "local"
            self._skipped = StepStats(dense_bytes=sum(4 * u.numel() for u in local.values()))
            return
        self._last_kind = "compressed"
        for name, u in self._average_momenta(means).items():
            p, state, group, denom = owners[name]
            self._hold_unseen(u, state)
            anchor = state.pop("anchor", None)
            if anchor is not None:
                p.copy_(anchor)
            state["exp_avg"].copy_(u).mul_(denom)
            state["step"] += 1
            p.add_(u, alpha=-totals[name])

    @property
    def compression_stats(self) -> Any:
        """Bytes of the last step (:class:`~hvd_compress.pipeline.StepStats`): the
        uncompressed all-reduce's at a variance update, the compressed momentum's at a
        compressed step or sync, and at a local step none (``payload_bytes`` 0, no
        collective; ``dense_bytes`` the float32 size an uncompressed step would send)."""
        if self._last_kind == "local":
            return self._skipped
        return (self._warmup if self._last_kind == "variance" else self._compressed).last_step

    # State ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """1-bit Adam's state dict (Adam's state with the round in progress per parameter,
        the step count, both residuals) plus the schedule and the round's last step."""
        state = super().state_dict()
        state[self.state_key].update({"round_end": self.round_end,
                                      **{o: getattr(self, o) for o in SCHEDULE_OPTIONS}})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get(self.state_key)
        if extra is not None:
            for option in SCHEDULE_OPTIONS:
                if extra[option] != getattr(self, option):
                    raise ValueError(
                        f"ZeroOneAdam: the checkpoint was saved with {option}={extra[option]}"
                        f" but this optimizer has {option}={getattr(self, option)}; "
                        f"construct it with the same {option}")
        super().load_state_dict(state_dict)
        if extra is not None:
            self.round_end = extra["round_end"]
