"""Random-k sparsification with shared indices and error feedback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hvd_compress.comm.ops import AllReduce
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scattered, Scheme
from hvd_compress.schemes.topk import check_ratio, sparse_count


class RandomK(Scheme):
    """Random-k sparsification (Stich et al. 2018, "Sparsified SGD with Memory").

    Every rank draws the same ``k = ceil(ratio * n)`` indices from a generator seeded by
    (seed, tensor, step), so the values are summable: only the ``k`` values travel, by
    a plain all-reduce (4 bytes per kept element, ``1 / ratio`` times smaller than
    float32), and no index crosses the wire. Unscaled, with error feedback: an element
    missed this step is sent later.
    """

    name = "randomk"
    error_feedback = True

    def __init__(self, ratio: float = 0.01) -> None:
        check_ratio(self.name, ratio)
        self.ratio = ratio

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

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "ratio": self.ratio}
