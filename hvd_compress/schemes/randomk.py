"""Random-k sparsification with shared indices and error feedback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

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


class RandomK(Scheme):
    """Random-k sparsification (Stich et al. 2018, "Sparsified SGD with Memory").

    Every rank draws the same ``k = ceil(ratio * n)`` indices from a generator seeded by
    (seed, tensor, step), so the values are summable: only the ``k`` values travel, by
    a plain all-reduce (4 bytes per kept element, ``1 / ratio`` times smaller than
    float32), and no index crosses the wire. Unscaled, with error feedback: an element
    missed this step is sent later. An element waits about ``1 / ratio`` steps, so heavy
    optimizer momentum amplifies the delayed bursts: the optimizer wrapper warns for
    momentum of 0.9 or more (:meth:`check_optimizer`).

    ``loco_beta``: the error-feedback memory (:meth:`~hvd_compress.schemes.base.Scheme.
    loco_option`): 0 (default) keeps the plain residual; in ``(0, 1)``, LoCo's moving
    average of the compression errors with this weight on the old residual.
    """

    name = "randomk"
    error_feedback = True

    def __init__(self, ratio: float = 0.01, loco_beta: float = 0.0) -> None:
        check_ratio(self.name, ratio)
        self.ratio = ratio
        self.loco_beta = self.loco_option(loco_beta)

    def payload_bytes(self, shape: torch.Size) -> int:
        return 4 * sparse_count(self.ratio, shape.numel())

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        flat = x.reshape(-1)
        k = sparse_count(self.ratio, flat.numel())
        gen = ctx.generator("indices", torch.device("cpu"), shared=True)
        indices = torch.randperm(flat.numel(), generator=gen)[:k].to(x.device)
        values = flat[indices]
        total = yield AllReduce("values", values)
        aggregate = Scattered(indices, total, x.shape)
        sent = Scattered(indices, values, x.shape)
        return Outcome(aggregate, sent, 4 * k)

    def check_optimizer(self, optimizer: Any) -> None:
        """Warns for optimizer momentum of 0.9 or more (:func:`warn_heavy_momentum`) and for
        Adam's family (:func:`warn_adaptive`)."""
        warn_heavy_momentum(self, optimizer, RANDOMK_MEASURED)
        warn_adaptive(self, optimizer, RANDOMK_ADAM_MEASURED)

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio}


RANDOMK_MEASURED = ("on digits (2 ranks, SGD lr 0.1, 600 steps) random-k at ratio 0.01 reached "
                    "19.4% test accuracy with momentum 0.9 (its loss peaked at 16) against "
                    "98.6% uncompressed, and 96.4% with momentum 0.8.")
RANDOMK_ADAM_MEASURED = ("on a character transformer (python -m hvd_compress.bench converge, "
                         "AdamW, 400 steps) the best random-k setting tried (ratio 0.3, lr "
                         "5.5e-3) ended 20% above uncompressed held-out loss, where top-k at "
                         "ratio 0.1 ended 1.0% below it.")
