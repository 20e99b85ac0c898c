"""Deep Gradient Compression: top-k with momentum correction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hvd_compress.comm.ops import SparseSum, nbytes
from hvd_compress.comm.ps_transport.base import counted_pairs
from hvd_compress.schemes.base import (
    Exchange,
    ExchangeContext,
    Outcome,
    Scattered,
    Scheme,
    optimizer_momentum,
)
from hvd_compress.schemes.topk import check_ratio, sparse_count, sparse_nbytes, value_dtype

MOMENTUM = "momentum"
VELOCITY = "velocity"


class DGC(Scheme):
    """Deep Gradient Compression (Lin et al. 2018, "Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training").

    Per tensor, with local gradient ``g``, momentum ``m``, kept state ``u`` (momentum) and
    ``v`` (accumulated velocity)::

        g <- g * min(1, clip_norm / (sqrt(N) ||g||))      local gradient clipping (N ranks)
        u <- m u + g                                      momentum correction
        v <- v + u
        send v on mask = {|v_i| >= threshold}              about k = density * n entries
        v[mask] <- 0;  u[mask] <- 0                        momentum factor masking

    The aggregate already carries momentum: the wrapped optimizer must run **without**
    momentum (``torch.optim.SGD(..., momentum=0)``). ``hvd_compress.torch.DistributedOptimizer``
    refuses one with momentum at construction (:meth:`check_optimizer`), since both momenta
    would compound and diverge. Give the optimizer's momentum to DGC instead (``Compression.dgc(
    momentum=0.9)`` with ``SGD(params, lr, momentum=0)``): without compression that is the
    same update as momentum SGD, the momentum applied before sparsification.

    The threshold is estimated from a random sample of ``sample_ratio * n`` magnitudes (at
    least 1000) instead of sorting all of them, aimed at ``1.5 k`` candidates; of those the
    exact top-``k`` is kept. ``values="fp16"`` sends the values as float16; their rounding
    error stays in ``v``.
    Sparsity warm-up: over the first ``warmup_steps`` exchanges the density falls
    geometrically in four equal stages from 25% to ``ratio`` (the paper's schedule of
    75% to 99.9% sparsity).

    Diagnostics: ``v`` is DGC's residual, so ``optimizer.compression_feedback`` reports
    ``||v_new||`` as the tensor's residual norm and ``||v_new|| / ||v||`` as its
    compression error (``v`` before and ``v_new`` after the entries sent were taken out),
    and a velocity that keeps growing raises the same
    :class:`~hvd_compress.feedback.ResidualGrowthWarning` as an error-feedback residual
    (:meth:`own_residual`).

    DGC has no ``loco_beta`` option: what it does not send stays in its velocity ``v``
    (scheme state, reset where sent by momentum factor masking), not in the pipeline's
    error-feedback memory that LoCo's moving average is an option of.
    """

    name = "dgc"
    sliceable = True
    error_feedback = False  # the velocity ``v`` is DGC's own residual
    residual_name = "velocity"

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9,
                 clip_norm: float | None = None, warmup_steps: int = 0,
                 sample_ratio: float = 0.01, values: str = "fp32") -> None:
        check_ratio(self.name, ratio)
        if not 0 <= momentum < 1:
            raise ValueError(f"dgc: momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None and clip_norm <= 0:
            raise ValueError(f"dgc: clip_norm must be positive, got {clip_norm}")
        if warmup_steps < 0 or not 0 < sample_ratio <= 1:
            raise ValueError("dgc: warmup_steps must be >= 0 and sample_ratio in (0, 1]")
        self.ratio = ratio
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.warmup_steps = warmup_steps
        self.sample_ratio = sample_ratio
        self.values = values
        self._dtype = value_dtype(self.name, values)

    def density(self, step: int) -> float:
        """The fraction of entries sent at this step (sparsity warm-up)."""
        if step >= self.warmup_steps or self.ratio >= 0.25:
            return self.ratio
        stage = step * 4 // self.warmup_steps
        return 0.25 * (self.ratio / 0.25) ** (stage / 4)

    def payload_bytes(self, shape: torch.Size) -> int:
        return sparse_nbytes(shape.numel(), sparse_count(self.ratio, shape.numel()), self.values)

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        g = x.reshape(-1)
        if self.clip_norm is not None:
            bound = self.clip_norm / math.sqrt(ctx.size)
            g = g * (bound / (g.norm() + 1e-12)).clamp(max=1.0)
        u = state.get(MOMENTUM)
        u = g.clone() if u is None else self.momentum * u + g
        v = state.get(VELOCITY)
        v = u.clone() if v is None else v + u

        k = sparse_count(self.density(ctx.step), v.numel())
        indices = self.select(v, k, ctx)
        request = SparseSum("sparse", v.numel(), indices, v[indices].to(self._dtype))
        # Pairs a server refused (a late push) or left out (--mode gtopk) count as not
        # sent (counted_pairs).
        total, indices, values = counted_pairs((yield request), indices, request.values)
        # What was not sent stays in v: nothing of the selected entries with fp32 values,
        # their rounding error with fp16.
        v = v.index_copy(0, indices, v[indices] - values.float())
        u = u.index_fill(0, indices, 0.0)
        # The pairs sent, for the step's density; the pipeline's memory ignores them (no
        # error_feedback: the residual is v).
        sent = Scattered(indices, values, x.shape)
        return Outcome(total.view_as(x), sent, nbytes(request), {MOMENTUM: u, VELOCITY: v})

    def own_residual(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The accumulated velocity ``v`` in a tensor's committed state (what is not sent
        yet: :class:`~hvd_compress.feedback.KeepsResidual`); ``None`` before its first
        step."""
        return state.get(VELOCITY)

    def select(self, v: torch.Tensor, k: int, ctx: ExchangeContext) -> torch.Tensor:
        """Indices of at most ``k`` entries of large ``|v|`` by the sampled threshold (the
        exact top-``k`` when the sample would be the whole tensor)."""
        n = v.numel()
        magnitude = v.abs()
        samples = min(n, max(1000, math.ceil(self.sample_ratio * n)))
        if samples >= n:
            return magnitude.topk(k, sorted=False).indices
        gen = ctx.generator("threshold-sample", torch.device("cpu"))
        sample = magnitude[torch.randint(n, (samples,), generator=gen).to(v.device)]
        # Aim 1.5x high, then keep the exact top-k of the (few) selected entries: the
        # estimate's noise then costs a slightly larger candidate set, not recall.
        k_sample = max(1, math.ceil(1.5 * k * samples / n))
        threshold = sample.topk(k_sample, sorted=False).values.min()
        selected = (magnitude >= threshold).nonzero().view(-1)
        if selected.numel() > k:
            selected = selected[magnitude[selected].topk(k, sorted=False).indices]
        return selected

    def check_optimizer(self, optimizer: Any) -> None:
        """``ValueError`` if any parameter group of ``optimizer`` has a non-zero
        ``momentum`` (SGD, RMSprop): DGC's momentum correction already applies momentum."""
        found = optimizer_momentum(optimizer)
        if found is not None:
            index, momentum = found
            raise ValueError(
                f"Compression.dgc applies momentum itself (momentum correction, "
                f"momentum={self.momentum}), but the wrapped optimizer "
                f"{type(optimizer).__name__} has momentum={momentum} in parameter group "
                f"{index}: both would compound and training diverges. Construct the "
                f"optimizer with momentum=0 and give the momentum to DGC, e.g. "
                f"{type(optimizer).__name__}(..., momentum=0) "
                f"with Compression.dgc(momentum={momentum})")

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "momentum": self.momentum, "clip_norm": self.clip_norm,
                "warmup_steps": self.warmup_steps, "sample_ratio": self.sample_ratio,
                "values": self.values}
