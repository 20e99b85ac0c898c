"""Top-k sparsification with error feedback."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hvd_compress import native
from hvd_compress import triton as gpu
from hvd_compress.comm.ops import nbytes
from hvd_compress.comm.ps_transport.base import counted_pairs
from hvd_compress.comm.sparse_frames import PairsSum, SummedPairs
from hvd_compress.native import sparse as native_sparse
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scattered, Scheme


def sparse_count(ratio: float, numel: int) -> int:
    """``k = ceil(ratio * n)``, at least 1 and at most ``n``."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def check_ratio(scheme: str, ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"{scheme}: ratio must be in (0, 1], got {ratio}")


VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def value_dtype(scheme: str, values: str) -> torch.dtype:
    """The torch dtype the pairs' values travel in: ``"fp32"`` or ``"fp16"``."""
    try:
        return VALUE_DTYPES[values]
    except KeyError:
        raise ValueError(f"{scheme}: values must be 'fp32' or 'fp16', got {values!r}") from None


def sparse_nbytes(numel: int, k: int, values: str) -> int:
    """Nominal bytes of ``k`` pairs: 4-byte indices plus the values (frames code indices
    as varints or a bitmap, so they are usually smaller; see :func:`ops.nbytes`)."""
    return k * (4 + torch.finfo(VALUE_DTYPES[values]).bits // 8)


SAMPLE = 1 << 12
"""Entries sampled by :func:`largest` to place its threshold."""

SPARE = 3
""":func:`largest`'s threshold lets about ``SPARE * k`` entries pass, so that fewer than
``k`` pass (and the full ``topk`` runs) in well under one call in a thousand at k = n/1000."""


def largest(magnitude: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of the ``k`` largest entries of the flat ``magnitude`` (as
    ``magnitude.topk(k).indices``, ties broken either way), in any order.

    ``torch.topk`` on a CPU keeps a heap over all ``n`` entries, which is slow for large
    tensors. Instead: the ``SPARE * k * n / m``-th largest of ``m`` sampled entries is a
    threshold that about ``SPARE * k`` entries pass; one comparison over all entries keeps
    those (numpy's on a CPU, several times faster than torch's ``nonzero`` there), and
    ``topk`` among them is the exact answer whenever at least ``k`` passed. If fewer passed
    (a sample that fell badly), the full ``topk`` runs, so the result is always exact.
    """
    n = magnitude.numel()
    if n <= 2 * SAMPLE or k > n // 64:
        return magnitude.topk(k, sorted=False).indices
    picks = torch.randint(0, n, (SAMPLE,), generator=generator).to(magnitude.device)
    rank = min(SAMPLE, max(1, -(-SPARE * k * SAMPLE // n)))
    threshold = magnitude[picks].topk(rank, sorted=False).values.min()
    candidates = None
    if gpu.active(magnitude):
        candidates = gpu.call("sparse.candidates", magnitude, threshold)
    elif magnitude.device.type == "cpu" and magnitude.dtype != torch.bfloat16:
        flat = magnitude.detach().reshape(-1).numpy()
        candidates = torch.from_numpy(np.flatnonzero(flat >= flat.dtype.type(threshold)))
    if candidates is None:
        candidates = (magnitude >= threshold).nonzero().view(-1)
    if candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


def largest_of(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of the ``k`` entries of largest magnitude of the flat ``x``: exactly
    ``largest(x.abs(), k, generator)`` (the same sample, threshold and candidates, in the
    same order, so the same indices), without the array of magnitudes where it can.

    On a CPU with the native library, a float32 ``x`` large enough to be sampled has its
    candidates picked in one pass over the signed values
    (:func:`hvd_compress.native.sparse.select_magnitude`: no ``|x|``, no mask of ``n``
    entries); only the sample and the candidates are taken in magnitude. Elsewhere, and
    when the library is unavailable, :func:`largest` of ``x.abs()``.
    """
    n = x.numel()
    if n <= 2 * SAMPLE or k > n // 64 or x.device.type != "cpu" \
            or x.dtype != torch.float32 or not native.available():
        return largest(x.abs(), k, generator)
    picks = torch.randint(0, n, (SAMPLE,), generator=generator)
    rank = min(SAMPLE, max(1, -(-SPARE * k * SAMPLE // n)))
    flat = x.detach().reshape(-1).numpy()
    # The sample's rank-th largest magnitude, NaN if it holds a NaN: what topk(rank)'s
    # values' min() is (topk takes NaN as the largest, min() propagates it).
    threshold = np.partition(np.abs(flat[picks.numpy()]), SAMPLE - rank)[SAMPLE - rank:].min()
    found = native_sparse.select_magnitude(flat, float(threshold), 2 * SPARE * k)
    if found is None or found.size < k:  # the library went away, or a sample fell badly
        return x.abs().topk(k, sorted=False).indices
    candidates = torch.from_numpy(found)
    return candidates[x[candidates].abs().topk(k, sorted=False).indices]


class TopK(Scheme):
    """Top-k sparsification (Aji & Heafield 2017, "Sparse Communication for Distributed
    Gradient Descent"; with error feedback as in Stich et al. 2018, "Sparsified SGD with
    Memory").

    Each rank sends the ``k = ceil(ratio * n)`` entries of largest magnitude of ``g + e``
    as (index, value) pairs and keeps the rest in its residual (with ``values="fp16"``
    the rounding of the sent values too). Indices differ between ranks, so the pairs are
    summed by a parameter server or by gathering them, not by a ring. On the wire
    (:mod:`hvd_compress.sparse_wire`) indices are delta+varint coded (one byte per
    7 bits of the gap between consecutive indices), plus 4 (fp32) or 2 (fp16) bytes per value.
    Gathered, the sum comes back as its pairs (:class:`~hvd_compress.comm.sparse_frames.
    PairsSum`) and is the aggregate as they are (:class:`~hvd_compress.schemes.base.
    Scattered`): the gradient is then written once, its zeros and the union's sums, with no
    dense sum to fill, check and copy.

    ``loco_beta``: the error-feedback memory (:meth:`~hvd_compress.schemes.base.Scheme.
    loco_option`): 0 (default) keeps the plain residual; in ``(0, 1)``, LoCo's moving
    average of the compression errors with this weight on the old residual.
    """

    name = "topk"
    sliceable = True
    error_feedback = True

    def __init__(self, ratio: float = 0.001, values: str = "fp32",
                 loco_beta: float = 0.0) -> None:
        check_ratio(self.name, ratio)
        self.ratio = ratio
        self.values = values
        self._dtype = value_dtype(self.name, values)
        self.loco_beta = self.loco_option(loco_beta)

    def payload_bytes(self, shape: torch.Size) -> int:
        return sparse_nbytes(shape.numel(), sparse_count(self.ratio, shape.numel()), self.values)

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        flat = x.reshape(-1)
        k = sparse_count(self.ratio, flat.numel())
        indices = largest_of(flat, k, ctx.generator("topk-sample", torch.device("cpu")))
        request = PairsSum("sparse", flat.numel(), indices, flat[indices].to(self._dtype))
        result = yield request
        if isinstance(result, SummedPairs):  # gathered frames: the sum kept as its pairs
            return Outcome(Scattered(result.indices, result.values, x.shape),
                           Scattered(indices, request.values, x.shape), nbytes(request))
        # Pairs a server refused (a late push) or left out (--mode gtopk) stay in the
        # residual (counted_pairs).
        total, indices, values = counted_pairs(result, indices, request.values)
        sent = Scattered(indices, values, x.shape)
        return Outcome(total.view_as(x), sent, nbytes(request))

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "values": self.values}
