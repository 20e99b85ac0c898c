"""QSGD: unbiased stochastic quantisation to b bits."""

from __future__ import annotations

from typing import Any

import torch

from hvd_compress import native, wire
from hvd_compress import triton as gpu
from hvd_compress.schemes.packed import PackedScheme, bucket_view


class QSGD(PackedScheme):
    """QSGD (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding"), bucketed, ``bits`` bits per element.

    For each bucket ``v`` of ``d = bucket_size`` elements, with ``s = 2**(bits-1) - 1``
    levels, ``l_i = floor(s |v_i| / ||v||_2)`` and ``p_i = s |v_i| / ||v||_2 - l_i``::

        Q(v)_i = ||v||_2 * sign(v_i) * xi_i / s,   xi_i = l_i + 1 with probability p_i, else l_i

    so ``E[Q(v)] = v`` (unbiased) and ``E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2``
    (the paper's Lemma 3.1). Unbiased, so error feedback is off by default.

    ``norm="max"`` (the default) scales by ``max_i |v_i|`` instead of ``||v||_2``: the same
    estimator on a finer grid, still unbiased, with variance at most
    ``d max_i|v_i|^2 / (4 s^2)``, below the 2-norm bound. With few levels and large buckets
    the 2-norm grid puts most elements of a dense bucket at level 0 or 1; ``norm="l2"``
    gives the paper's exact estimator.

    ``s |v_i| / ||v||`` is computed as ``|v_i| * (s / ||v||)``, the 2-norm in float64 and
    rounded to float32 once. CPU tensors are coded by :mod:`hvd_compress.native`, with the
    same arithmetic and layout as the torch code here (which other devices run) but other
    uniform draws: a counter-based hash keyed by one number from ``generator`` instead of
    ``torch.rand``.

    Wire: the signed level ``sign * xi + s`` (in ``0 .. 2s``) as ``bits``-bit codes
    (:func:`wire.pack_codes`), then one float32 norm (scale) per bucket. Defaults ``bits=4``,
    ``bucket_size=512``: 32 / (4 + 32/512) = 7.9x smaller than float32.

    Diagnostics: ``optimizer.compression_feedback`` reports each tensor's ``||Q(x) - x|| /
    ||x||``, large by design for an unbiased quantiser; it warns of nothing, and a change of
    level within a run is what to look at. See docs/benchmarks.md#convergence for typical levels.

    Args:
        bits: bits per element including the sign, 2..8 (default 4).
        bucket_size: elements per norm (default 512).
        norm: ``"max"`` (default) or ``"l2"``, the scale of each bucket.
        error_feedback: keep the quantisation error in a residual (default off: the
            estimator is unbiased).
        loco_beta: only with ``error_feedback=True``: 0 (default) keeps the plain residual;
            in ``(0, 1)``, LoCo's moving average of the compression errors with this weight
            on the old residual (:meth:`~hvd_compress.schemes.base.Scheme.loco_option`),
            applied to the rank's residual; the reducing rank's residual of its chunk stays
            the plain one.
    """

    name = "qsgd"
    sliceable = True

    def __init__(self, bits: int = 4, bucket_size: int = 512, norm: str = "max",
                 error_feedback: bool = False, loco_beta: float = 0.0) -> None:
        if not 2 <= bits <= 8:
            raise ValueError(f"qsgd: bits must be 2..8 (one bit is the sign), got {bits}")
        if bucket_size < 1:
            raise ValueError(f"qsgd: bucket_size must be positive, got {bucket_size}")
        if norm not in ("max", "l2"):
            raise ValueError(f"qsgd: norm must be 'max' or 'l2', got {norm!r}")
        self.bits = bits
        self.norm = norm
        self.levels = 2 ** (bits - 1) - 1
        self.bucket_size = bucket_size
        self.error_feedback = error_feedback
        self.loco_beta = self.loco_option(loco_beta)

    def chunk_bytes(self, numel: int) -> int:
        buckets = (numel + self.bucket_size - 1) // self.bucket_size
        return wire.codes_nbytes(numel, self.bits) + 4 * buckets

    kernel = "qsgd"

    def encode_options(self, generator: torch.Generator) -> tuple[int | float, ...]:
        return self.bits, self.norm == "l2", native.seed(generator)

    def decode_options(self) -> tuple[int, ...]:
        return (self.bits,)

    def encode(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if native.active(x):
            return native.encode(self.kernel, x, self.bucket_size, self.chunk_bytes(x.numel()),
                                 *self.encode_options(generator))
        if gpu.active(x) and (out := gpu.encode_packed(
                "qsgd", x, self.bucket_size, generator, bits=self.bits,
                l2=self.norm == "l2")) is not None:
            return out
        s = self.levels
        rows, _ = bucket_view(x, self.bucket_size)
        if self.norm == "max":
            norm = rows.abs().amax(dim=1)
        else:
            norm = rows.double().square().sum(dim=1).sqrt().float()
        # s / norm as one correctly rounded division, as the native kernel does it (a
        # Python number over a tensor is tensor.reciprocal() * s: two roundings).
        divisor = norm.clamp_min(torch.finfo(torch.float32).tiny)
        inv = torch.full_like(divisor, s).div_(divisor)
        scaled = rows.abs().mul_(inv.unsqueeze(1)).view(-1)[: x.numel()]
        noise = torch.rand(scaled.shape, generator=generator, device=x.device)
        level = scaled.add_(noise).floor_().clamp_(0, s).nan_to_num_(0.0)
        codes = torch.where(x < 0, s - level, s + level)
        return torch.cat([wire.pack_codes(codes, self.bits), wire.floats_to_bytes(norm)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        code_bytes = wire.codes_nbytes(numel, self.bits)
        codes, norms = wire.split_sections(
            payload, [code_bytes, self.chunk_bytes(numel) - code_bytes], "qsgd payload")
        if native.active(payload):
            return native.decode(self.kernel, payload, numel, self.bucket_size,
                                 *self.decode_options())
        if gpu.active(payload) and (out := gpu.decode_packed(
                "qsgd", payload, numel, self.bucket_size, self.bits)) is not None:
            return out
        values = wire.unpack_codes(codes, numel, self.bits).to(torch.float32)
        # norm / s with the divisor a tensor on the payload's device: ATen's CUDA kernel
        # divides by a Python number as a multiplication by its float32 reciprocal, one ulp
        # off the division of the CPU and the native kernel for about half of all norms.
        norms = wire.bytes_to_floats(norms)
        scale = norms / torch.full_like(norms, self.levels)
        return values.sub_(self.levels).mul_(scale.repeat_interleave(self.bucket_size)[:numel])

    def options(self) -> dict[str, Any]:
        return {"bits": self.bits, "bucket_size": self.bucket_size, "norm": self.norm,
                "error_feedback": self.error_feedback}
