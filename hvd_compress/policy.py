"""Which tensors to compress and which to send dense."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hvd_compress.schemes.base import Scheme


@dataclass(frozen=True)
class Policy:
    """Per-tensor routing: a tensor is compressed only if every rule lets it through.

    Args:
        min_numel: tensors with fewer elements go dense. Their bytes are negligible and
            Horovod fuses them into one all-reduce, while encoding them would cost a kernel
            launch each and, for bucketed codecs, a whole bucket's scale.
        compress_1d: 1-D tensors (biases, normalisation weights) go dense unless this is
            set: they are small, and their errors shift every activation of a layer.
        min_compression_rate: tensors the scheme would shrink by less go dense. ``None``
            uses the scheme's own threshold (PowerSGD's ``min_compression_rate``; 1 for the
            others, whose rate does not depend on the shape).
    """

    min_numel: int = 1024
    compress_1d: bool = False
    min_compression_rate: float | None = None

    def compresses(self, scheme: Scheme, shape: torch.Size) -> bool:
        if shape.numel() < max(self.min_numel, 1) or not scheme.applies_to(shape):
            return False
        if len(shape) <= 1 and not self.compress_1d:
            return False
        threshold = self.min_compression_rate
        if threshold is None:
            threshold = scheme.min_compression_rate
        return scheme.compression_rate(shape) >= threshold
