"""TernGrad: unbiased stochastic ternarisation."""

from __future__ import annotations

from typing import Any

import torch

from hvd_compress import native, wire
from hvd_compress import triton as gpu
from hvd_compress.schemes.packed import PackedScheme, bucket_view


class TernGrad(PackedScheme):
    """TernGrad (Wen et al. 2017, "TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning").

    For each bucket ``v`` with scale ``s = max_i |v_i|``::

        T(v)_i = s * sign(v_i) * b_i,   b_i ~ Bernoulli(|v_i| / s)

    so ``E[T(v)] = v``. The variance of ``T(v)_i`` is ``|v_i| (s - |v_i|)``: it grows with
    the bucket's largest entry, so one outlier makes every other entry noisy. Hence the
    paper's gradient clipping (its Section 3.3), on by default: each bucket is first clipped
    to ``[-clip*sigma, clip*sigma]`` (``sigma`` its standard deviation; default
    ``clip=2.5``, the paper's choice, which leaves nearly all entries of a Gaussian bucket
    unchanged). That shrinks ``s`` and the variance at the price of a small bias;
    ``error_feedback=True`` carries the clipped part to the next step instead of dropping
    it. ``clip=None`` is the unclipped, unbiased quantiser; keep the clipping on unless the
    gradients have no outliers (see docs/benchmarks.md#convergence).

    ``|v_i| / s`` is computed as ``|v_i| * (1 / s)``; the clipping statistics in float64,
    the bound rounded to float32 once. CPU tensors are coded by :mod:`hvd_compress.native`,
    with the same arithmetic and layout as the torch code here (which other devices run)
    but other uniform draws: a counter-based hash keyed by one number from ``generator``.

    Wire: trits packed five per byte (1.6 bits per element, :func:`wire.pack_trits`), then
    one float32 scale per bucket. Default ``bucket_size=512``: 32 / (1.6 + 32/512) = 19.2x.

    Diagnostics: ``optimizer.compression_feedback`` reports each tensor's ``||T(x) - x|| /
    ||x||``, which is large by design (``E ||T(v) - v||^2 = sum_i |v_i| (s - |v_i|)`` per
    bucket); it warns of nothing, and a change of level within a run is what to look at.

    Args:
        bucket_size: elements per scale (default 512).
        clip: clip each bucket to ``clip`` standard deviations (default 2.5); ``None``
            turns clipping off.
        error_feedback: carry the clipping and quantisation error to the next step
            (default off).
        loco_beta: only with ``error_feedback=True``: 0 (default) keeps the plain residual;
            in ``(0, 1)``, LoCo's moving average of the compression errors with this weight
            on the old residual (:meth:`~hvd_compress.schemes.base.Scheme.loco_option`),
            applied to the rank's residual; the reducing rank's residual of its chunk stays
            the plain one.
    """

    name = "terngrad"
    sliceable = True

    def __init__(self, bucket_size: int = 512, clip: float | None = 2.5,
                 error_feedback: bool = False, loco_beta: float = 0.0) -> None:
        if bucket_size < 1:
            raise ValueError(f"terngrad: bucket_size must be positive, got {bucket_size}")
        if clip is not None and clip <= 0:
            raise ValueError(f"terngrad: clip must be positive (the paper uses 2.5), got {clip}")
        self.bucket_size = bucket_size
        self.clip = clip
        self.error_feedback = error_feedback
        self.loco_beta = self.loco_option(loco_beta)

    def chunk_bytes(self, numel: int) -> int:
        buckets = (numel + self.bucket_size - 1) // self.bucket_size
        return wire.trits_nbytes(numel) + 4 * buckets

    kernel = "terngrad"

    def encode_options(self, generator: torch.Generator) -> tuple[int | float, ...]:
        return self.clip or 0.0, native.seed(generator)

    def encode(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if native.active(x):
            return native.encode(self.kernel, x, self.bucket_size, self.chunk_bytes(x.numel()),
                                 *self.encode_options(generator))
        if gpu.active(x) and (out := gpu.encode_packed(
                "terngrad", x, self.bucket_size, generator, clip=self.clip)) is not None:
            return out
        rows, counts = bucket_view(x, self.bucket_size)
        if self.clip is not None:
            rows64, counts64 = rows.double(), counts.double().unsqueeze(1)
            mean = rows64.sum(dim=1, keepdim=True) / counts64
            sq = (rows64 - mean).square()
            sq.view(-1)[x.numel():] = 0
            bound = (self.clip * (sq.sum(dim=1, keepdim=True) / counts64).sqrt()).float()
            rows = torch.maximum(torch.minimum(rows, bound), -bound)
        scale = rows.abs().amax(dim=1)
        inv = 1 / scale.clamp_min(torch.finfo(torch.float32).tiny)
        prob = rows.abs().mul_(inv.unsqueeze(1))
        prob = prob.view(-1)[: x.numel()]
        keep = torch.rand(prob.shape, generator=generator, device=x.device) < prob
        trits = torch.sign(rows.view(-1)[: x.numel()]).mul_(keep).nan_to_num_(0.0)
        return torch.cat([wire.pack_trits(trits), wire.floats_to_bytes(scale)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        trit_bytes = wire.trits_nbytes(numel)
        trits, scales = wire.split_sections(
            payload, [trit_bytes, self.chunk_bytes(numel) - trit_bytes], "terngrad payload")
        if native.active(payload):
            return native.decode(self.kernel, payload, numel, self.bucket_size)
        if gpu.active(payload) and (out := gpu.decode_packed(
                "terngrad", payload, numel, self.bucket_size)) is not None:
            return out
        scale = wire.bytes_to_floats(scales).repeat_interleave(self.bucket_size)[:numel]
        return wire.unpack_trits(trits, numel).to(torch.float32).mul_(scale)

    def options(self) -> dict[str, Any]:
        return {"bucket_size": self.bucket_size, "clip": self.clip,
                "error_feedback": self.error_feedback}
