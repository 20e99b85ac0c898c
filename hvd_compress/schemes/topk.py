"""Top-k sparsification with error feedback."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hvd_compress.comm.ops import SparseSum
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scheme


def sparse_count(ratio: float, numel: int) -> int:
    """``k = ceil(ratio * n)``, at least 1 and at most ``n``."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def check_ratio(scheme: str, ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"{scheme}: ratio must be in (0, 1], got {ratio}")


class TopK(Scheme):
    """Top-k sparsification (Aji & Heafield 2017, "Sparse Communication for Distributed
    Gradient Descent"; with error feedback as in Stich et al. 2018, "Sparsified SGD with
    Memory").

    Each rank sends the ``k = ceil(ratio * n)`` entries of largest magnitude of ``g + e``
    as (index, value) pairs and keeps the rest in its residual. Indices differ between
    ranks, so the pairs are summed by gathering them (or by the parameter server), not by
    a ring. 8 bytes per pair here: ``1 / (2 ratio)`` times smaller than float32.
    """

    name = "topk"
    error_feedback = True

    def __init__(self, ratio: float = 0.001) -> None:
        check_ratio(self.name, ratio)
        self.ratio = ratio

    def payload_bytes(self, shape: torch.Size) -> int:
        return 8 * sparse_count(self.ratio, shape.numel())

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        flat = x.reshape(-1)
        k = sparse_count(self.ratio, flat.numel())
        indices = flat.abs().topk(k, sorted=False).indices
        values = flat[indices]
        total = yield SparseSum("sparse", flat.numel(), indices, values)
        sent = torch.zeros_like(flat).index_copy_(0, indices, values)
        return Outcome(total.view_as(x), sent.view_as(x), 8 * k)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "ratio": self.ratio}
