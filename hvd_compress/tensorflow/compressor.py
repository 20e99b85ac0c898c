"""Horovod's TensorFlow ``Compressor`` interface for the stateless schemes.

``hvd.DistributedGradientTape(tape, compression=Compression.fp16)`` calls
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)`` on TensorFlow tensors,
possibly symbolic ones inside a ``tf.function``; these are the TensorFlow halves of
:class:`~hvd_compress.schemes.dense.FP16` and :class:`~hvd_compress.schemes.dense.BF16`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def fp16_compress(tensor: Any) -> tuple[Any, Any]:
    """Floating-point tensors cast to float16, with their dtype to restore; others as is."""
    if tensor.dtype.is_floating:
        return tf.cast(tensor, tf.float16), tensor.dtype
    return tensor, None


def fp16_decompress(tensor: Any, ctx: Any) -> Any:
    return tensor if ctx is None else tf.cast(tensor, ctx)


BF16_REFUSED = (
    "Compression.bf16 cannot be used with Horovod's own hvd.DistributedGradientTape: Horovod "
    "0.28.1's TensorFlow all-reduce rejects bfloat16 tensors ('Value for attr T of bfloat16 "
    "is not in the list of allowed values'). Use hvd_compress.tensorflow."
    "DistributedGradientTape(tape, compression=Compression.bf16) (or hvd_compress.tensorflow."
    "keras.DistributedOptimizer), which sums bfloat16 payloads in float32, or Compression.fp16 "
    "with Horovod's tape.")
