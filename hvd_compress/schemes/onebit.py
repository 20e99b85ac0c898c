"""1-bit SGD with error feedback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hvd_compress import native, wire
from hvd_compress import triton as gpu
from hvd_compress.schemes.base import (
    Exchange,
    ExchangeContext,
    warn_adaptive,
    warn_heavy_momentum,
)
from hvd_compress.schemes.packed import PackedScheme, bucket_view
from hvd_compress.schemes.warmup import check_start_iter, dense_warmup


class OneBit(PackedScheme):
    """1-bit quantisation with error feedback (Seide et al. 2014, "1-Bit Stochastic Gradient
    Descent and its Application to Data-Parallel Distributed Training of Speech DNNs").

    Each bucket ``v`` of ``bucket_size`` elements is sent as its signs and one scale::

        s = mean_i |v_i|            (the least-squares scale: argmin_s ||v - s sign(v)||^2)
        decode(v)_i = s if v_i >= 0 else -s

    The quantisation error is carried to the next step by error feedback, without which
    sign compression does not converge in general (Karimireddy et al. 2019).

    Every element moves by the bucket's scale every step, so heavy momentum amplifies the
    quantisation noise: the optimizer wrapper warns for momentum of 0.9 or more
    (:meth:`check_optimizer`). Under Adam's family every element of a bucket decodes to the
    bucket's magnitude and error feedback releases the residual in bursts, which Adam's
    second moment takes as noise; a dense warm-up (``start_iter``) lets the second moment
    start from exact gradients. Advice: under SGD keep momentum below 0.9 or shrink
    ``bucket_size``; under Adam's family pass ``start_iter`` of about 10% of the steps and
    ``bucket_size`` of at most :data:`ADAM_BUCKET_SIZE`, or use
    :class:`~hvd_compress.torch.OneBitAdam`. See docs/benchmarks.md#convergence.

    The scale is summed in float64 and rounded to float32 once. CPU tensors are coded by
    :mod:`hvd_compress.native`, to the same bytes as the torch code here (which other
    devices run); its float64 sums add in another order, which can only move a scale's
    last float32 bit when a sum lies within float64 rounding of a float32 tie.

    Wire: ``ceil(n/8)`` bytes of sign bits (1 = non-negative; :func:`wire.pack_bits`), then
    ``ceil(n/bucket_size)`` float32 scales. With the default ``bucket_size=2048`` the payload
    is 32 / (1 + 32/2048) = 31.5x smaller than float32.

    Args:
        bucket_size: elements per scale, a positive multiple of 8 (default 2048).
        loco_beta: the error-feedback memory (:meth:`~hvd_compress.schemes.base.Scheme.
            loco_option`): 0 (default) keeps the plain residual; in ``(0, 1)``, LoCo's
            moving average of the compression errors with this weight on the old residual.
            It is the rank's residual (the input side of the compressed all-reduce) that is
            averaged; the reducing rank's residual of its chunk stays the plain one.
        start_iter: the first ``start_iter`` exchanges of each tensor are plain float32
            all-reduces that keep no residual (:mod:`hvd_compress.schemes.warmup`, as
            PowerSGD's warm-up); 0 (default) compresses from the first step.
    """

    name = "onebit"
    fusion_mb = 8.01
    """The optimizers' bucket size (MiB of float32 gradients) for 1-bit when ``bucket_mb``
    is not given (:func:`hvd_compress.policy.default_bucket_mb`): a 2 M-element layer and a
    bias of up to 2,600 elements per bucket, so that a layer's all-to-all starts while
    backward computes the layers before it. Measured against the 64 MiB default on the
    emulated cluster (docs/benchmarks.md, "Across models and launchers")."""
    sliceable = True
    error_feedback = True
    kernel = "onebit"

    def __init__(self, bucket_size: int = 2048, loco_beta: float = 0.0,
                 start_iter: int = 0) -> None:
        if bucket_size < 8 or bucket_size % 8:
            raise ValueError(f"onebit: bucket_size must be a positive multiple of 8, "
                             f"got {bucket_size}")
        self.bucket_size = bucket_size
        self.loco_beta = self.loco_option(loco_beta)
        self.start_iter = check_start_iter(self.name, start_iter)

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        if ctx.step < self.start_iter:
            return (yield from dense_warmup(x, state))
        return (yield from super().exchange(x, state, ctx))

    def chunk_bytes(self, numel: int) -> int:
        buckets = (numel + self.bucket_size - 1) // self.bucket_size
        return wire.bits_nbytes(numel) + 4 * buckets

    def encode(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if native.active(x):
            return native.encode(self.kernel, x, self.bucket_size, self.chunk_bytes(x.numel()))
        if gpu.active(x) and (out := gpu.encode_packed("onebit", x, self.bucket_size)) is not None:
            return out
        rows, counts = bucket_view(x, self.bucket_size)
        scale = (rows.abs().sum(dim=1, dtype=torch.float64) / counts).float()
        return torch.cat([wire.pack_bits(x >= 0), wire.floats_to_bytes(scale)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        bits, scales = wire.split_sections(
            payload, [wire.bits_nbytes(numel), self.chunk_bytes(numel) - wire.bits_nbytes(numel)],
            "onebit payload")
        if native.active(payload):
            return native.decode(self.kernel, payload, numel, self.bucket_size)
        if gpu.active(payload) and \
                (out := gpu.decode_packed("onebit", payload, numel, self.bucket_size)) is not None:
            return out
        signs = wire.unpack_bits(bits, numel).to(torch.float32).mul_(2).sub_(1)
        scale = wire.bytes_to_floats(scales).repeat_interleave(self.bucket_size)[:numel]
        return signs.mul_(scale)

    def check_optimizer(self, optimizer: Any) -> None:
        """Warns for optimizer momentum of 0.9 or more (:func:`warn_heavy_momentum`) and for
        Adam's family (:func:`warn_adaptive`) unless :meth:`trains_under_adam`."""
        warn_heavy_momentum(self, optimizer, ONEBIT_MEASURED)
        if not self.trains_under_adam():
            warn_adaptive(self, optimizer, ONEBIT_ADAM_MEASURED, ONEBIT_ADAM_ADVICE)

    def trains_under_adam(self) -> bool:
        """Whether these settings train under Adam's family: a dense warm-up
        (``start_iter`` > 0) and buckets of at most :data:`ADAM_BUCKET_SIZE` elements."""
        return self.start_iter > 0 and self.bucket_size <= ADAM_BUCKET_SIZE

    def options(self) -> dict[str, Any]:
        # start_iter only when set, so checkpoints of a 1-bit without warm-up (written
        # before the option existed, too) describe the same scheme.
        return {"bucket_size": self.bucket_size,
                **({"start_iter": self.start_iter} if self.start_iter else {})}


ONEBIT_MEASURED = ("on digits (2 ranks, SGD lr 0.1, 600 steps) 1-bit reached 61.7% test "
                   "accuracy with momentum 0.9 against 98.6% uncompressed, and 98.1% with "
                   "momentum 0.8.")
ONEBIT_ADAM_MEASURED = ("on a character transformer (python -m hvd_compress.bench converge, "
                        "AdamW, 400 steps) 1-bit without a dense warm-up ended at best 5.8% "
                        "above uncompressed held-out loss (bucket_size=32, 3x the lr), and "
                        "with a warm-up but buckets of 256 or more 4.0% to 6.4% above (3x "
                        "the lr).")
ONEBIT_ADAM_ADVICE = ("With start_iter at 10% of the steps (the first exchanges of each tensor "
                      "uncompressed, so Adam's second moment starts from exact gradients) and "
                      "bucket_size of 128 or less it ended at most 1.0% above at 2x or 3x the lr "
                      "(bucket_size=32: 0.2% above at 2x, 2.7% below at 3x, 14x fewer bytes "
                      "per step after the warm-up): pass both, e.g. "
                      "Compression.onebit(bucket_size=32, start_iter=40) for 400 steps.")
ADAM_BUCKET_SIZE = 128
"""The largest ``bucket_size`` that :meth:`OneBit.trains_under_adam` accepts (with a dense
warm-up of about 10% of the steps). See docs/benchmarks.md#convergence."""
