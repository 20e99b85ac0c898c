"""Rank-side half of the bfloat16 tests of tests/test_tensorflow_parity.py: a Keras model
whose variables are bfloat16, trained with each scheme, and bfloat16 tensors through each
collective of the TensorFlow binding (Horovod 0.28.1's TensorFlow ops refuse bfloat16)."""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd_tf
import keras
import numpy as np
import tensorflow as tf
import torch

from hvd_compress import Compression, Policy
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll
from hvd_compress.tensorflow import HorovodTFCommunicator, broadcast_variables
from hvd_compress.tensorflow.comm import to_tf
from hvd_compress.tensorflow.keras import BroadcastGlobalVariablesCallback, DistributedOptimizer
from tests.workers.bf16 import bf16_value
from tests.workers.tf_collectives import horovod_tf
from tests.workers.tf_keras import _Recorder


def _model(seed: int) -> keras.Model:
    """Two bfloat16 Dense layers; the logits are cast to float32 for the loss."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((32,)), keras.layers.Dense(64, activation="relu", dtype="bfloat16"),
        keras.layers.Dense(10, dtype="bfloat16"),
        keras.layers.Activation("linear", dtype="float32")])


def _flat(variables: Any) -> np.ndarray:
    """The variables' values as one float32 vector (exact for bfloat16)."""
    return np.concatenate([np.asarray(v.numpy()).astype(np.float32).reshape(-1)
                           for v in variables])


def training(specs: list[str], batches: int = 4) -> dict[str, Any]:
    """Per scheme: a bfloat16 model initialised differently on each rank, broadcast from
    rank 0 by the callback, fit for ``batches`` steps on rank-specific data with SGD
    momentum (bfloat16 slots; none for DGC, which applies its own); then every rank adds
    rank + 1 to its momentum slots and the optimizer's variables are broadcast from
    rank 0. Returns the weights before the broadcast, after it and after every step, the
    momentum slots after their broadcast, the variables' dtypes and the byte ratio."""
    out: dict[str, Any] = {}
    with horovod_tf():
        gen = np.random.default_rng(100 + hvd_tf.rank())
        x = gen.standard_normal((8 * batches, 32)).astype(np.float32)
        y = gen.integers(0, 10, 8 * batches).astype(np.int64)
        for spec in specs:
            model = _model(seed=hvd_tf.rank())
            initial = _flat(model.trainable_variables)
            compression = Compression.parse(spec)
            momentum = 0.0 if compression.name == "dgc" else 0.9
            optimizer = DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=momentum),
                                             compression=compression,
                                             policy=Policy(min_numel=256))
            model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
            recorder = _Recorder()
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                      callbacks=[BroadcastGlobalVariablesCallback(0), recorder])
            slots = [v for v in optimizer.variables if v.dtype == "bfloat16"]
            for slot in slots:
                slot.assign(slot + tf.cast(hvd_tf.rank() + 1, tf.bfloat16))
            broadcast_variables(optimizer.variables, root_rank=0)
            out[spec] = {
                "initial": initial,
                "weights": [w.astype(np.float32) for w in recorder.weights],
                "momentum": _flat(slots) if slots else None,
                "dtypes": sorted({str(v.dtype) for v in model.trainable_variables}),
                "ratio": optimizer.compression_totals.ratio}
    return out


def collectives() -> dict[str, Any]:
    """This rank's bfloat16 tensor (the torch test's, :func:`tests.workers.bf16.bf16_value`)
    through each collective of the TensorFlow binding's
    communicator (an all-reduce, an all-gather, an all-to-all) and through
    ``broadcast_variables`` of a bfloat16 ``tf.Variable``, eagerly and inside a
    ``tf.function``. Values come back as torch bfloat16 tensors."""
    out: dict[str, Any] = {}
    with horovod_tf():
        comm = HorovodTFCommunicator()
        x = bf16_value(hvd_tf.rank())
        ops = {"allreduce": AllReduce("r", x),
               "allgather": AllGather("g", x, (x.numel(),) * comm.size),
               "alltoall": AllToAll("a", x, (400, 600))}
        started = {name: comm.start(f"bf16.{name}", op) for name, op in ops.items()}
        out.update({name: comm.wait(handle) for name, handle in started.items()})
        eager = tf.Variable(to_tf(x))
        broadcast_variables([eager], root_rank=1)
        traced = tf.Variable(to_tf(x))

        @tf.function
        def broadcast_traced() -> None:
            broadcast_variables([traced], root_rank=1)

        broadcast_traced()
        for name, variable in (("broadcast", eager), ("broadcast_traced", traced)):
            out[name] = torch.from_numpy(np.asarray(variable.numpy()).view(np.int16).copy()
                                         ).view(torch.bfloat16)
    return out
