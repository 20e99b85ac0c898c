"""Rank-side half of the majority-vote tests of tests/test_tensorflow_parity.py:
``Compression.vote`` through the TensorFlow binding's tape and Keras optimizer."""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd_tf
import keras
import numpy as np
import tensorflow as tf

from hvd_compress import Compression, Policy
from hvd_compress.tensorflow import DistributedGradientTape, compression_state
from hvd_compress.tensorflow.keras import DistributedOptimizer
from tests.workers.tf_collectives import horovod_tf

ALL = Policy(min_numel=1, compress_1d=True)
LR = 0.01


def _tape_votes(x: np.ndarray, traced: bool) -> tuple[np.ndarray, dict[str, int]]:
    """``sum(v * x)``'s gradient with respect to ``v`` (``x`` exactly) through
    ``DistributedGradientTape(compression=Compression.vote(), op=hvd.Sum)``; returns the
    aggregate and the step's bytes per round."""
    compression = Compression.vote()
    v = tf.Variable(tf.zeros_like(x))
    xs = tf.constant(x)

    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            target = tf.reduce_sum(v * xs)
        tape = DistributedGradientTape(tape, compression=compression, op=hvd_tf.Sum,
                                       policy=ALL)
        return tape.gradient(target, v)

    aggregate = (tf.function(step) if traced else step)()
    exchange = compression_state(compression).exchange
    assert exchange is not None
    return aggregate.numpy(), dict(exchange.last_step.collective_bytes)


def votes(numel: int = 8000) -> dict[str, Any]:
    """This rank's input, the tape's summed vote (eager and traced) with its bytes, and one
    Keras ``SGD(LR)`` step under ``Compression.vote()``: the weights before and after it and
    this rank's local gradients (weights start equal on every rank, data differ)."""
    out: dict[str, Any] = {"lr": LR}
    with horovod_tf():
        gen = np.random.default_rng(50 + hvd_tf.rank())
        x = gen.standard_normal(numel).astype(np.float32)
        x[:16] = 0.0  # exact zeros vote +1
        out["x"] = x
        for path in ("eager", "traced"):
            out[path], out[f"{path}_bytes"] = _tape_votes(x, path == "traced")

        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = DistributedOptimizer(keras.optimizers.SGD(LR), compression=Compression.vote(),
                                         policy=ALL)
        inputs = gen.standard_normal((8, 16)).astype(np.float32)
        labels = gen.integers(0, 4, 8)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        with tf.GradientTape() as tape:
            value = loss(labels, model(inputs))
        grads = tape.gradient(value, model.trainable_variables)
        out["before"] = [v.numpy() for v in model.trainable_variables]
        out["grads"] = [g.numpy() for g in grads]
        optimizer.apply(grads, model.trainable_variables)
        out["after"] = [v.numpy() for v in model.trainable_variables]
        out["keras_ratio"] = optimizer.compression_stats.ratio
    return out
