"""Threshold sparsification with error feedback: every entry above a fixed magnitude."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from hvd_compress.comm.ops import SparseSum, nbytes
from hvd_compress.comm.ps_transport.base import counted_pairs
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scattered, Scheme
from hvd_compress.schemes.topk import (
    check_ratio,
    largest,
    sparse_count,
    sparse_nbytes,
    value_dtype,
)


class ThresholdCapWarning(UserWarning):
    """More entries of a tensor exceeded ``tau`` than ``max_ratio`` lets through."""


class Threshold(Scheme):
    """Threshold sparsification (Strom 2015, "Scalable Distributed DNN Training Using
    Commodity GPU Cloud Computing"; with error feedback as in Stich et al. 2018).

    Each rank sends every entry of ``x = g + e`` with ``|x_i| > tau`` as an (index, value)
    pair and keeps the others in its residual, so an entry too small to send accumulates
    until it crosses ``tau``. Selection is one comparison over the tensor: no sort, no
    sample, the cheapest sparsifier of the family; in exchange the density is not fixed
    but follows the gradients' magnitude, step by step and tensor by tensor (reported per
    tensor and step as ``density`` in ``optimizer.compression_feedback``, the bytes in
    ``optimizer.compression_stats``). The pairs travel as top-k's do: the sparse frames of
    :mod:`hvd_compress.sparse_wire`, summed by the parameter server (``ps=``) or by Horovod
    ``allgather``.

    Edge cases:

    * **Nothing exceeds tau**: the rank sends an empty frame (it still counts for the
      parameter server's round and for the ``allgather``), its whole ``x`` stays in the
      residual, and the aggregate holds only the other ranks' pairs (all zero if no rank
      sent any). The residual grows until its entries cross ``tau``.
    * **Everything exceeds tau**: every entry is sent (up to ``max_ratio``, below), the
      residual is only the rounding of ``values="fp16"`` (zero with fp32), and the frame
      codes its indices as a bitmap or not at all (its dense coding), so the wire never
      carries more than float32 would plus the frame's header.
    * **Not-a-number**: an entry that is NaN is always selected (it compares neither above
      nor below ``tau``), so it reaches the aggregate and the pipeline's finite check
      raises :class:`~hvd_compress.errors.NonFiniteGradientError` instead of the NaN
      hiding in a residual.

    Frame size guard: each selected entry costs 12 bytes of host memory on the way out
    (an int64 index and its value) and every rank receives every other rank's frame, so a
    ``tau`` that is too small (``tau=0`` sends every non-zero entry) would silently make a
    large tensor's exchange several times the size of its float32 gradient. So at most
    ``k = ceil(max_ratio * n)`` entries are sent: when more exceed ``tau``, the ``k``
    largest of them are (the exact top-k, with top-k's sampled pre-selection, so that step
    pays for a selection), the others stay in the residual, and
    :class:`ThresholdCapWarning` names the tensor, the step and the density ``tau`` asked
    for (once per tensor). ``max_ratio=1`` removes the cap.

    Args:
        tau: the magnitude an entry of ``g + e`` must exceed to be sent (``> tau``, strictly),
            ``>= 0``. Default ``1e-3``, a magnitude typical of a small network's gradient
            entries; the right value depends on the model, the loss scale and the learning
            rate (the density in ``optimizer.compression_feedback`` tells).
        max_ratio: the most entries sent per tensor and step, as a fraction of its size, in
            ``(0, 1]``. Default 0.1: above 10% the pairs save less than 5x over float32 and
            a threshold sparsifier is no longer the right tool.
        values: ``"fp32"`` (default) or ``"fp16"`` (halves the values' bytes; the rounding
            stays in the residual).
        loco_beta: the error-feedback memory (:meth:`~hvd_compress.schemes.base.Scheme.
            loco_option`): 0 (default), the plain residual; in ``(0, 1)``, LoCo's moving
            average of the compression errors with this weight on the old residual.
    """

    name = "threshold"
    sliceable = True
    error_feedback = True

    def __init__(self, tau: float = 1e-3, max_ratio: float = 0.1, values: str = "fp32",
                 loco_beta: float = 0.0) -> None:
        if not tau >= 0 or tau == float("inf"):
            raise ValueError(f"threshold: tau must be a finite number >= 0, got {tau}")
        check_ratio(self.name, max_ratio)
        self.tau = float(tau)
        self.max_ratio = max_ratio
        self.values = values
        self._dtype = value_dtype(self.name, values)
        self.loco_beta = self.loco_option(loco_beta)
        self._capped: set[str] = set()  # tensors already warned about

    def payload_bytes(self, shape: torch.Size) -> int:
        """Nominal bytes at the cap, ``k = ceil(max_ratio * n)`` pairs, the most one step
        can send (the policy and ``Compression.auto`` plan with it): the smaller of 4-byte
        indices and a bitmap, plus the values; only the values when ``k = n`` (the frame's
        dense coding). What a step sent, usually much less, is in its statistics."""
        n = shape.numel()
        k = sparse_count(self.max_ratio, n)
        value_bytes = torch.finfo(self._dtype).bits // 8
        if k == n:
            return n * value_bytes
        return min(sparse_nbytes(n, k, self.values), -(-n // 8) + k * value_bytes)

    def select(self, flat: torch.Tensor, ctx: ExchangeContext) -> torch.Tensor:
        """Flat indices of the entries to send: ``|x_i| > tau`` (NaN included), at most
        ``ceil(max_ratio * n)`` of them (the largest, when more pass)."""
        magnitude = flat.abs()
        indices = magnitude.le(self.tau).logical_not_().nonzero().view(-1)
        cap = sparse_count(self.max_ratio, flat.numel())
        if indices.numel() <= cap:
            return indices
        if ctx.name not in self._capped:
            self._capped.add(ctx.name)
            warnings.warn(ThresholdCapWarning(
                f"threshold: {indices.numel()} of the {flat.numel()} entries of "
                f"{ctx.name!r} exceed tau={self.tau:g} at step {ctx.step} (density "
                f"{indices.numel() / flat.numel():.3g}), more than max_ratio="
                f"{self.max_ratio:g} allows: sending the {cap} largest and keeping the "
                "rest in the residual. Raise tau (or max_ratio, if the memory and bytes "
                "are acceptable)."), stacklevel=2)
        return largest(magnitude.nan_to_num_(nan=float("inf")), cap,
                       ctx.generator("threshold-sample", torch.device("cpu")))

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        flat = x.reshape(-1)
        indices = self.select(flat, ctx)
        request = SparseSum("sparse", flat.numel(), indices, flat[indices].to(self._dtype))
        # Pairs a server refused (a late push) or left out (--mode gtopk) stay in the
        # residual (counted_pairs).
        total, indices, values = counted_pairs((yield request), indices, request.values)
        sent = Scattered(indices, values, x.shape)
        return Outcome(total.view_as(x), sent, nbytes(request))

    def options(self) -> dict[str, Any]:
        return {"tau": self.tau, "max_ratio": self.max_ratio, "values": self.values}
