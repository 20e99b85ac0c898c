"""``OneBitAdam``: Adam whose momentum, not its gradient, is exchanged with 1-bit compression.

1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed", ICML; DeepSpeed's ``OnebitAdam``). Quantising the gradient
before Adam puts the quantisation noise into Adam's second moment ``v``, which divides
every step; 1-bit Adam observes that ``v`` settles early in training and then changes
slowly, so it runs in two stages:

1. **Warm-up** (the first ``freeze_step`` steps): plain Adam on gradients averaged over all
   ranks by an uncompressed all-reduce. It is ``torch.optim.Adam`` itself (this class is
   one), so until ``freeze_step`` a run is bit for bit a Horovod-averaged Adam run.
2. **Compression** (every later step): ``v`` is frozen at its value after the warm-up.
   Each rank updates the momentum with its own, local gradient and exchanges it with the
   compressed all-reduce of 1-bit SGD (:mod:`hvd_compress.schemes.packed`)::

       m_local = beta1 * m + (1 - beta1) * (g_local + weight_decay * p)
       d       = sqrt(v / (1 - beta2^freeze_step)) + eps            (frozen, every rank alike)
       u_local = clip(m_local / d, -B, B),  B = max(1, (1 - beta1) / sqrt(1 - beta2))
       u       = mean over ranks of u_local, 1-bit compressed with error feedback on the
                 worker side (each rank's residual) and on the reducing side (each chunk's
                 residual), as in the paper's Algorithm 1
       m       = u * d;   p -= lr / (1 - beta1^t) * u

   Every rank ends with the same ``m``, so parameters stay identical without a broadcast.
   The wire carries 1 bit per element plus one float32 scale per 2048 elements (31.5x less
   than float32) for the tensors the policy compresses (by default tensors of at least
   1024 elements and two or more dimensions); the others' momentum is averaged exactly.

Three choices differ from DeepSpeed's ``OnebitAdam``; without the first two, training
diverges soon after ``freeze_step`` (see docs/benchmarks.md#convergence):

- The momentum travels in the frozen preconditioner's units, ``m / d``. Since ``d`` is
  the same on every rank, the average is the same quantity, but one bucket's 1-bit scale
  (the mean magnitude) no longer mixes elements whose Adam steps differ by orders of
  magnitude: sent as ``m`` itself, an element with a tiny frozen ``v`` received the
  bucket's scale over its tiny ``sqrt(v)``.
- ``u`` is clipped to ``B``, the bound of Adam's own per-element step (Kingma & Ba 2015,
  Section 2.1). With ``v`` frozen an element whose gradients start after the warm-up
  would otherwise step by ``m / eps``.
- Elements whose frozen ``v`` is exactly 0 (no gradient in the whole warm-up) do not
  move; DeepSpeed asks the user for that mask (``exp_avg_mask``).

Bias corrections follow ``torch.optim.Adam`` (the second moment's is frozen with ``v``), so
the update is continuous at ``freeze_step``; weight decay is Adam's (added to the
gradient). Advice: DeepSpeed's default ``freeze_step`` is 100000; the paper freezes after
about 15-25% of the training steps.

The two stages, the exchange and the state dict are :class:`OneBitMomentum`'s, which
:class:`~hvd_compress.torch.OneBitLamb` shares (only the update differs) and
:class:`~hvd_compress.torch.ZeroOneAdam` extends. The exchange happens in :meth:`step`:
call ``loss.backward()`` then ``optimizer.step()`` on every rank, with the same parameters
in the same order. ``state_dict()`` holds Adam's state plus the compression state (both
residuals, step counters), so a checkpoint taken mid-compression resumes to the same next
step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.compression import Compression
from hvd_compress.pipeline import Pipeline
from hvd_compress.policy import Policy
from hvd_compress.schemes.base import Scheme

STATE_KEY = "hvd_compress_onebit_adam"


class OneBitMomentum(torch.optim.Optimizer, ABC):
    """What 1-bit Adam and 1-bit LAMB share: a warm-up on gradients averaged by an
    uncompressed all-reduce, then a frozen variance and the momentum exchanged in the
    frozen preconditioner's units by 1-bit compression with error feedback on both sides
    (the module docstring), plus naming, statistics and the state dict.

    A subclass puts itself before its base optimizer (``class OneBitAdam(OneBitMomentum,
    torch.optim.Adam)``), calls :meth:`_setup` after the base's ``__init__``, and gives
    :meth:`_warmup_update` (one step of the plain optimizer on the averaged gradients) and
    :meth:`_apply_momentum` (the update from the averaged momentum). Its parameter groups
    hold Adam's ``betas``, ``eps`` and ``weight_decay``; its state Adam's ``step``,
    ``exp_avg`` and ``exp_avg_sq``. A subclass with another schedule (0/1 Adam,
    :class:`~hvd_compress.torch.ZeroOneAdam`) also overrides :meth:`_exchanges_gradients`
    (which steps exchange the gradients uncompressed), :meth:`_denominator` (the
    preconditioner of a variance that is not frozen once) and :meth:`_compressed_step`,
    from the pieces :meth:`_local_momenta`, :meth:`_average_momenta` and
    :meth:`_hold_unseen`.
    """

    averages_across_ranks = True  # DistributedOptimizer refuses to wrap it (binding.py)
    state_key = STATE_KEY
    freeze_option = "freeze_step"
    """The constructor's name for :attr:`freeze_step`, in error messages."""
    decay_in_gradient = True
    """Weight decay added to the gradient before the momentum (Adam's L2), or not (LAMB
    adds it to the update)."""

    def _setup(self, freeze_step: int, named_parameters: Iterable[tuple[str, torch.Tensor]]
               | None, compression: Scheme | None, policy: Policy | None,
               comm: Communicator | None, seed: int) -> None:
        label = type(self).__name__
        compression = compression if compression is not None else Compression.onebit()
        if not compression.error_feedback:
            raise ValueError(f"{label} needs a compression scheme with error feedback "
                             f"(Compression.onebit()), got {compression!r}")
        self.freeze_step = freeze_step
        self._names = self._name_parameters(named_parameters)
        if comm is None:
            from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator

            comm = HorovodTorchCommunicator()
        self._warmup = Pipeline(Compression.none, comm, policy, average=True, seed=seed)
        self._compressed = Pipeline(compression, comm, policy, average=True, seed=seed)
        self.global_step = 0

    @staticmethod
    def _check_freeze_step(freeze_step: int) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) \
                or freeze_step < 0:
            raise ValueError(f"freeze_step must be an integer >= 0, got {freeze_step!r}")

    def _name_parameters(self, named: Iterable[tuple[str, torch.Tensor]] | None
                         ) -> dict[torch.Tensor, str]:
        label = type(self).__name__
        params = [p for group in self.param_groups for p in group["params"]]
        if named is None:
            prefix = self.state_key.removeprefix("hvd_compress_")
            return {p: f"{prefix}.{i}.{j}" for i, group in enumerate(self.param_groups)
                    for j, p in enumerate(group["params"])}
        names: dict[torch.Tensor, str] = {}
        for name, p in named:
            if name in names.values():
                raise ValueError(f"{label}: parameter name {name!r} is given twice")
            names[p] = name
        missing = [tuple(p.shape) for p in params if p not in names]
        if missing:
            raise ValueError(f"{label}: named_parameters lacks {len(missing)} optimised "
                             f"parameter(s) (shapes {missing})")
        return names

    @property
    def frozen(self) -> bool:
        """Whether the next step compresses (the warm-up is over)."""
        return self.global_step >= self.freeze_step

    @property
    def compression_stats(self) -> Any:
        """Bytes of the last step (:class:`~hvd_compress.pipeline.StepStats`): the
        uncompressed all-reduce's in the warm-up, the compressed momentum's after."""
        return (self._compressed if self.global_step > self.freeze_step
                else self._warmup).last_step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]
                  if p.requires_grad]
        for p in params:
            if p.grad is None:  # another rank may have one: exchange zeros
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                raise TypeError(f"{type(self).__name__}: parameter {self._names[p]!r} has "
                                "a sparse gradient; it needs dense gradients")
        if self._exchanges_gradients():
            names = {self._names[p]: p for p in params}
            for name, p in names.items():
                self._warmup.submit(name, p.grad)
            self._warmup.wait({name: p.grad for name, p in names.items()})
            self._warmup_update()
        else:
            self._compressed_step()
        self.global_step += 1
        return loss

    def _exchanges_gradients(self) -> bool:
        """Whether this step averages the gradients uncompressed and runs
        :meth:`_warmup_update` (otherwise it runs :meth:`_compressed_step`): in the warm-up."""
        return not self.frozen

    @abstractmethod
    def _warmup_update(self) -> None:
        """One step of the plain optimizer; the gradients are already averaged."""

    def _trained(self) -> Iterator[tuple[dict[str, Any], torch.Tensor, dict[str, Any]]]:
        """(group, parameter, its state) of every parameter that requires a gradient, in
        group order: the same order on every rank."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield group, p, self.state[p]

    def _adam_moments(self) -> Iterator[tuple[dict[str, Any], torch.Tensor, dict[str, Any]]]:
        """:meth:`_trained`, with Adam's state created at a parameter's first step (step
        0, both moments 0), as ``torch.optim.Adam`` creates it."""
        for group, p, state in self._trained():
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            yield group, p, state

    @abstractmethod
    def _apply_momentum(self, p: torch.Tensor, u: torch.Tensor, state: dict[str, Any],
                        group: dict[str, Any], denom: torch.Tensor) -> None:
        """Update ``p`` and its ``state`` from ``u``, the averaged momentum in the frozen
        preconditioner's units (``m = u * denom``; ``state["exp_avg"]`` still holds the
        previous momentum and ``state["step"]`` the previous count)."""

    def _denominator(self, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        """The frozen preconditioner ``d = sqrt(v / (1 - beta2^k)) + eps`` of a parameter,
        ``k`` the steps behind its frozen variance (recorded at the first compressed step)."""
        frozen_at = state.setdefault("frozen_at", float(state["step"]))
        denom = (state["exp_avg_sq"] / (1 - group["betas"][1] ** frozen_at)).sqrt_()
        return denom.add_(group["eps"])

    def _local_momenta(self) -> tuple[dict[str, torch.Tensor],
                                      dict[str, tuple[torch.Tensor, dict[str, Any],
                                                      dict[str, Any], torch.Tensor]]]:
        """Each parameter's momentum updated with this rank's gradient, in the frozen
        preconditioner's units and within Adam's step bound (``u_local`` of the module
        docstring), by name; and by name its (parameter, state, group, denominator)."""
        local: dict[str, torch.Tensor] = {}
        owners: dict[str, tuple[torch.Tensor, dict[str, Any], dict[str, Any],
                                torch.Tensor]] = {}
        for group, p, state in self._trained():
            beta1, beta2 = group["betas"]
            if "exp_avg_sq" not in state:
                raise RuntimeError(
                    f"{type(self).__name__}: parameter {self._names[p]!r} has no second "
                    f"moment to freeze ({self.freeze_option}=0, or it never had a gradient "
                    f"in the warm-up); use {self.freeze_option} >= 1")
            denom = self._denominator(state, group)
            grad = p.grad
            if group["weight_decay"] and self.decay_in_gradient:
                grad = grad.add(p, alpha=group["weight_decay"])
            name = self._names[p]
            m = state["exp_avg"].mul(beta1).add_(grad, alpha=1 - beta1)
            # In the frozen preconditioner's units, within Adam's own step bound.
            bound = max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)
            local[name] = m.div_(denom).clamp_(-bound, bound)
            owners[name] = (p, state, group, denom)
        return local, owners

    def _average_momenta(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ranks' mean of each tensor by the compressed all-reduce (written into the
        local tensors)."""
        for name, u in local.items():
            self._compressed.submit(name, u)
        return self._compressed.wait(local)

    @staticmethod
    def _hold_unseen(u: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """``u`` with 0 where the frozen variance is 0 (in place)."""
        if not bool(state["exp_avg_sq"].all()):
            # Never a gradient in the warm-up: 1-bit codes still give these elements
            # +-scale; they stay put, as Adam would leave them.
            u.masked_fill_(state["exp_avg_sq"] == 0, 0.0)
        return u

    def _compressed_step(self) -> None:
        local, owners = self._local_momenta()
        for name, u in self._average_momenta(local).items():
            p, state, group, denom = owners[name]
            self._apply_momentum(p, self._hold_unseen(u, state), state, group, denom)

    # State ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state plus the step count and the compressed exchange's
        state (worker and reducing-side residuals, step counters)."""
        state = super().state_dict()
        state[self.state_key] = {"global_step": self.global_step,
                                 "freeze_step": self.freeze_step,
                                 "compression": self._compressed.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop(self.state_key, None)
        if extra is not None and extra["freeze_step"] != self.freeze_step:
            option = self.freeze_option
            raise ValueError(f"{type(self).__name__}: the checkpoint was saved with "
                             f"{option}={extra['freeze_step']} but this optimizer has "
                             f"{option}={self.freeze_step}; construct it with the same "
                             f"{option}")
        super().load_state_dict(state_dict)
        if extra is not None:
            self._compressed.load_state_dict(extra["compression"])
            self.global_step = int(extra["global_step"])


class OneBitAdam(OneBitMomentum, torch.optim.Adam):
    """Adam with 1-bit compressed momentum after a warm-up (see the module docstring).

    Args:
        params: the parameters (or parameter groups), as for ``torch.optim.Adam``.
        lr: Adam's learning rate (default 1e-3).
        betas: Adam's moment coefficients (default ``(0.9, 0.999)``).
        eps: Adam's denominator term (default 1e-8).
        weight_decay: Adam's weight decay, added to the gradient (default 0).
        freeze_step: warm-up steps of plain, uncompressed Adam before the variance is
            frozen and the momentum compressed. Default 100000 (DeepSpeed's); set it to
            about 15-25% of the run's steps.
        named_parameters: ``model.named_parameters()``: names keying the residuals in the
            state dict, identical on every rank. Default: ``onebit_adam.<group>.<index>``.
        compression: the packed scheme that carries the momentum. Default
            ``Compression.onebit()`` (1 bit per element, error feedback on both sides).
        policy: which tensors are compressed (default :class:`hvd_compress.Policy`).
        comm: the communicator; default Horovod's (``hvd.init()`` first). Tests pass a
            :class:`~hvd_compress.comm.threads.ThreadGroup` rank.
        seed: base of the schemes' random streams, the same on every rank. Default 0.

    Raises ``ValueError`` at construction for options that 1-bit Adam does not support
    (``amsgrad``, ``maximize``, a capturable or differentiable Adam), for a compression
    scheme without error feedback, and for duplicated or missing parameter names.
    """

    def __init__(self, params: Any, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, freeze_step: int = 100_000,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Scheme | None = None, policy: Policy | None = None,
                 comm: Communicator | None = None, seed: int = 0, **adam_options: Any) -> None:
        for option in ("amsgrad", "maximize", "capturable", "differentiable"):
            if adam_options.get(option):
                raise ValueError(f"{type(self).__name__} does not support {option}=True: "
                                 "its frozen variance and compressed momentum replace Adam's "
                                 "own update")
        self._check_freeze_step(freeze_step)
        torch.optim.Adam.__init__(self, params, lr=lr, betas=betas, eps=eps,
                                  weight_decay=weight_decay, **adam_options)
        self._setup(freeze_step, named_parameters, compression, policy, comm, seed)

    def _warmup_update(self) -> None:
        torch.optim.Adam.step(self)

    def _apply_momentum(self, p: torch.Tensor, u: torch.Tensor, state: dict[str, Any],
                        group: dict[str, Any], denom: torch.Tensor) -> None:
        state["exp_avg"].copy_(u).mul_(denom)
        state["step"] += 1
        p.add_(u, alpha=-group["lr"] / (1 - group["betas"][0] ** float(state["step"])))
