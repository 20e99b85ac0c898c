"""Random-k sparsification with shared indices and error feedback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hvd_compress import triton as gpu
from hvd_compress.comm.ops import AllReduce
from hvd_compress.schemes.base import (
    Exchange,
    ExchangeContext,
    Outcome,
    Scattered,
    Scheme,
    warn_adaptive,
    warn_heavy_momentum,
)
from hvd_compress.schemes.topk import check_ratio, sparse_count
from hvd_compress.schemes.warmup import check_start_iter, dense_warmup


class RandomK(Scheme):
    """Random-k sparsification (Stich et al. 2018, "Sparsified SGD with Memory").

    Every rank draws the same ``k = ceil(ratio * n)`` indices from a generator seeded by
    (seed, tensor, step), so the values are summable: only the ``k`` values travel, by
    a plain all-reduce (4 bytes per kept element, ``1 / ratio`` times smaller than
    float32), and no index crosses the wire. By default unscaled, with error feedback: an
    element missed this step is sent later. An element waits about ``1 / ratio`` steps, so
    heavy optimizer momentum amplifies the delayed bursts: the optimizer wrapper warns for
    momentum of 0.9 or more (:meth:`check_optimizer`).

    Under Adam's family the delayed bursts are what hurts: a coordinate that waited ``T``
    steps arrives with about ``T`` gradients summed, and Adam's second moment takes the
    bursts as noise. Without error feedback each coordinate's gradient reaches Adam with
    probability ``ratio`` and is dropped otherwise; Adam's first moment then holds about
    ``ratio * g`` and its second about ``ratio * g^2``, so its step is about
    ``sqrt(ratio)`` times Adam's, and the learning rate divided by ``sqrt(ratio)`` makes up
    for it. Scaling by ``n / k`` (``unbiased=True``) does not change Adam's step, which does
    not depend on the gradient's scale. Advice: under Adam's family pass
    ``error_feedback=False``, no warm-up, a ratio of at least :data:`ADAM_MIN_RATIO` and the
    learning rate divided by ``sqrt(ratio)``; the optimizer wrapper warns otherwise
    (:meth:`trains_under_adam`). See docs/benchmarks.md#convergence.

    Args:
        ratio: the fraction of each tensor's entries sent per step (``k = ceil(ratio n)``).
        loco_beta: the error-feedback memory (:meth:`~hvd_compress.schemes.base.Scheme.
            loco_option`): 0 (default) keeps the plain residual; in ``(0, 1)``, LoCo's
            moving average of the compression errors with this weight on the old residual.
        error_feedback: keep the entries not sent in a residual and send them later
            (default, Stich et al.'s memory, what SGD needs); ``False`` drops them, as Adam
            needs (see above).
        unbiased: multiply the kept values by ``n / k``, so the aggregate's expectation over
            the draw is the exact sum (Wangni et al. 2018's unbiased random sparsification);
            only without error feedback (a residual would subtract the scaled values and
            grow). Default ``False``.
        start_iter: the first ``start_iter`` exchanges of each tensor are plain float32
            all-reduces that keep no residual (:mod:`hvd_compress.schemes.warmup`); default
            0. Under Adam's family it helps with error feedback and hurts without.
    """

    name = "randomk"
    sliceable = True
    error_feedback = True

    def __init__(self, ratio: float = 0.01, loco_beta: float = 0.0, error_feedback: bool = True,
                 unbiased: bool = False, start_iter: int = 0) -> None:
        check_ratio(self.name, ratio)
        if unbiased and error_feedback:
            raise ValueError("randomk: unbiased=True scales the kept values by n/k, which "
                             "error feedback would subtract from the residual as if they had "
                             "been the gradient's (the residual then grows every step); pass "
                             "error_feedback=False with it")
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.unbiased = unbiased
        self.loco_beta = self.loco_option(loco_beta)
        self.start_iter = check_start_iter(self.name, start_iter)

    def payload_bytes(self, shape: torch.Size) -> int:
        return 4 * sparse_count(self.ratio, shape.numel())

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        if ctx.step < self.start_iter:
            return (yield from dense_warmup(x, state))
        flat = x.reshape(-1)
        k = sparse_count(self.ratio, flat.numel())
        gen = ctx.generator("indices", torch.device("cpu"), shared=True)
        indices = torch.randperm(flat.numel(), generator=gen)[:k].to(x.device)
        factor = flat.numel() / k if self.unbiased else None
        values = gpu.call("sparse.gather", flat, indices, factor) \
            if gpu.active(flat) and flat.dtype == torch.float32 else None
        if values is None:
            values = flat[indices]
            if self.unbiased:
                values = values * factor
        total = yield AllReduce("values", values)
        aggregate = Scattered(indices, total, x.shape)
        sent = Scattered(indices, values, x.shape)
        return Outcome(aggregate, sent, 4 * k)

    def check_optimizer(self, optimizer: Any) -> None:
        """Warns for optimizer momentum of 0.9 or more with error feedback
        (:func:`warn_heavy_momentum`) and for Adam's family (:func:`warn_adaptive`) unless
        :meth:`trains_under_adam`."""
        if self.error_feedback:  # no residual, no delayed bursts for momentum to amplify
            warn_heavy_momentum(self, optimizer, RANDOMK_MEASURED)
        if not self.trains_under_adam():
            warn_adaptive(self, optimizer, RANDOMK_ADAM_MEASURED, RANDOMK_ADAM_ADVICE)

    def trains_under_adam(self) -> bool:
        """Whether these settings train under Adam's family: no error feedback, no
        warm-up, and a ratio of at least :data:`ADAM_MIN_RATIO`."""
        return not self.error_feedback and not self.start_iter and \
            self.ratio >= ADAM_MIN_RATIO

    def options(self) -> dict[str, Any]:
        # The later options only when they differ from their defaults, so checkpoints of a
        # plain random-k (written before they existed, too) describe the same scheme.
        extra = {"error_feedback": self.error_feedback, "unbiased": self.unbiased,
                 "start_iter": self.start_iter}
        defaults = {"error_feedback": True, "unbiased": False, "start_iter": 0}
        return {"ratio": self.ratio,
                **{key: value for key, value in extra.items() if value != defaults[key]}}


RANDOMK_MEASURED = ("on digits (2 ranks, SGD lr 0.1, 600 steps) random-k at ratio 0.01 reached "
                    "19.4% test accuracy with momentum 0.9 (its loss peaked at 16) against "
                    "98.6% uncompressed, and 96.4% with momentum 0.8.")
RANDOMK_ADAM_MEASURED = ("on a character transformer (python -m hvd_compress.bench converge, "
                         "AdamW, 400 steps) random-k with error feedback ended at best 20% "
                         "above uncompressed held-out loss (ratio 0.3, lr 5.5e-3), 8.7% with a "
                         "dense warm-up of 10% of the steps.")
RANDOMK_ADAM_ADVICE = ("Without error feedback and warm-up, at the learning rate divided by "
                       "sqrt(ratio), it ended 0.5% below uncompressed at ratio 0.3 (lr 5.5e-3 "
                       "for 3e-3), 1.3% above at 0.2 and 4.6% above at 0.1: pass "
                       "error_feedback=False and a ratio of 0.2 or more, e.g. "
                       "Compression.randomk(ratio=0.3, error_feedback=False).")
ADAM_MIN_RATIO = 0.2
"""The smallest ``ratio`` that :meth:`RandomK.trains_under_adam` accepts (without error
feedback). See docs/benchmarks.md#convergence."""
