"""Rank-side halves of tests/test_tensorflow.py for Keras 3 and the gradient tape (run under
horovodrun or mpirun; each function starts and stops Horovod's TensorFlow library)."""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf

from hvd_compress import Compression, Policy
from hvd_compress.tensorflow import (
    DistributedGradientTape,
    XLACompileError,
    broadcast_variables,
    compression_state,
)
from hvd_compress.tensorflow.keras import BroadcastGlobalVariablesCallback, DistributedOptimizer
from tests.workers.tf_collectives import horovod_tf

POLICY = Policy(min_numel=256)


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def _data(batches: int, batch_size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Rank-specific inputs and labels."""
    gen = np.random.default_rng(7 + hvd_tf.rank())
    n = batches * batch_size
    return (gen.standard_normal((n, 16)).astype(np.float32),
            gen.integers(0, 10, n).astype(np.int64))


def _weights(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(v.numpy()).reshape(-1) for v in model.trainable_variables])


class _Recorder(keras.callbacks.Callback):
    """The model's weights at the start of training and after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[np.ndarray] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self.weights:
            self.weights.append(_weights(self.model))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.weights.append(_weights(self.model))


def _compile(model: keras.Model, spec: str, **kwargs: Any) -> keras.optimizers.Optimizer:
    compression = Compression.parse(spec)
    momentum = 0.0 if compression.name == "dgc" else 0.9  # DGC applies its own (and checks)
    optimizer = DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=momentum),
                                     compression=compression, policy=POLICY)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), **kwargs)
    return optimizer


def fit_steps(specs: list[str], batches: int = 4) -> dict[str, Any]:
    """Per scheme: weights after the initial broadcast and after every ``model.fit`` step,
    starting from rank-specific initial weights; plus the byte ratio of the last step."""
    out: dict[str, Any] = {}
    with horovod_tf():
        x, y = _data(batches)
        for spec in specs:
            model = _model(seed=10 + hvd_tf.rank())
            optimizer = _compile(model, spec)
            recorder = _Recorder()
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                      callbacks=[BroadcastGlobalVariablesCallback(0), recorder])
            out[spec] = {"weights": recorder.weights,
                         "ratio": optimizer.compression_totals.ratio,
                         "feedback": {name: (stats.scheme, stats.steps) for name, stats in
                                      optimizer.compression_feedback.items()}}
    return out


def stock_horovod() -> dict[str, Any]:
    """What Horovod 0.28.1's own Keras and broadcast functions do with Keras 3, next to ours.

    Both optimizers start from the same weights on every rank and take one ``fit`` step on
    rank-specific data.
    """
    out: dict[str, Any] = {}
    with horovod_tf():
        x, y = _data(1)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model = _model(seed=3)
        model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss=loss)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        out["stock_fit"] = _weights(model)
        model = _model(seed=3)
        model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        out["ours_fit"] = _weights(model)

        model = _model(seed=20 + hvd_tf.rank())
        try:
            hvd_tf.broadcast_variables(model.variables, root_rank=0)
            out["stock_broadcast_error"] = None
        except Exception as exc:  # recorded for the parent to check
            out["stock_broadcast_error"] = f"{type(exc).__name__}: {exc}"
        out["before_broadcast"] = _weights(model)
        broadcast_variables(model.variables, root_rank=0)
        out["after_broadcast"] = _weights(model)
        out.update(_stock_tape())
    return out


def _stock_tape() -> dict[str, Any]:
    """Horovod's own tape with ``Compression.fp16`` (eager and traced), and the schemes it
    must refuse."""
    out: dict[str, Any] = {}
    w = tf.Variable(tf.ones([4, 3]))
    x = tf.constant(_data(1)[0][:, :4])

    def grads(compression: Any) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
        local = tape.gradient(loss, w)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
        tape = hvd_tf.DistributedGradientTape(tape, compression=compression)
        return local, tape.gradient(loss, [w])[0]

    local, eager = grads(Compression.fp16)
    _, traced = tf.function(lambda: grads(Compression.fp16))()
    out["fp16"] = {"local": local.numpy(), "eager": eager.numpy(), "traced": traced.numpy()}
    for spec in ("bf16", "onebit"):
        try:
            grads(Compression.parse(spec))
            out[spec] = None
        except TypeError as exc:
            out[spec] = str(exc)
    return out


def _tape_step(model: keras.Model, optimizer: keras.optimizers.Optimizer, compression: Any,
               x: tf.Tensor, y: tf.Tensor, report_every: int = 10) -> Any:
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
        loss = tf.reduce_mean(loss)
    tape = DistributedGradientTape(tape, compression=compression, policy=POLICY,
                                   report_every=report_every)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return tape


def _feedback(report: dict[str, Any]) -> dict[str, tuple[str, int]]:
    return {name: (stats.scheme, stats.steps) for name, stats in report.items()}


def _tape_run(spec: str, batches: list[tuple[tf.Tensor, tf.Tensor]], traced: bool,
              checkpoint_dir: Path | None = None) -> dict[str, Any]:
    """Train with the tape; optionally checkpoint before the last step, then restore into a
    fresh model, optimizer and compression object and take that step again. Eagerly the
    tape measures the compression error at every step (``report_every=1``), traced every
    10th (the default); ``feedback`` is the last tape's report."""
    def setup(seed: int) -> tuple[keras.Model, keras.optimizers.Optimizer, Any, Any]:
        model = _model(seed)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
        compression = Compression.parse(spec)

        if traced:
            def step(x: tf.Tensor, y: tf.Tensor) -> None:
                _tape_step(model, optimizer, compression, x, y)

            return model, optimizer, compression, tf.function(step)
        return model, optimizer, compression, partial(_tape_step, model, optimizer,
                                                      compression, report_every=1)

    model, optimizer, compression, step = setup(seed=5)
    weights = []
    for i, (x, y) in enumerate(batches):
        if checkpoint_dir is not None and i == len(batches) - 1:
            tf.train.Checkpoint(model=model, optimizer=optimizer,
                                compression=compression_state(compression)
                                ).write(str(checkpoint_dir / "tape"))
        tape = step(x, y)
        weights.append(_weights(model))
    out: dict[str, Any] = {"weights": weights, "feedback": _feedback(
        compression_state(compression).compression_feedback)}
    if not traced:  # the tape's own view is the compression object's
        assert tape.compression_feedback.keys() == out["feedback"].keys()
    if checkpoint_dir is not None:
        model, optimizer, compression, step = setup(seed=99)
        tf.train.Checkpoint(model=model, optimizer=optimizer,
                            compression=compression_state(compression)
                            ).read(str(checkpoint_dir / "tape")).assert_consumed()
        step(*batches[-1])
        out["resumed"] = _weights(model)
        # Control: the same restore without the compression state.
        model, optimizer, compression, step = setup(seed=99)
        tf.train.Checkpoint(model=model, optimizer=optimizer
                            ).read(str(checkpoint_dir / "tape")).expect_partial()
        step(*batches[-1])
        out["resumed_without_state"] = _weights(model)
    return out


def _keras_resume(spec: str, x: np.ndarray, y: np.ndarray, checkpoint_dir: Path,
                  how: str) -> dict[str, Any]:
    """``train_on_batch`` through all batches with the Keras wrapper, saving before the last;
    restore into a fresh model and optimizer (``tf.train.Checkpoint`` or a Keras weights
    file) and take the last step again."""
    def setup(seed: int) -> keras.Model:
        model = _model(seed)
        _compile(model, spec)
        model.optimizer.build(model.trainable_variables)
        return model

    model = setup(seed=5)
    batches = len(x) // 8
    path = checkpoint_dir / ("keras.weights.h5" if how == "keras" else "keras-ckpt")
    for i in range(batches):
        if i == batches - 1:
            if how == "keras":
                model.save_weights(path)
            else:
                tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(path))
        model.train_on_batch(x[8 * i:8 * (i + 1)], y[8 * i:8 * (i + 1)])
    resumed = setup(seed=99)
    if how == "keras":
        resumed.load_weights(path)
    else:
        tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer
                            ).read(str(path)).assert_consumed()
    resumed.train_on_batch(x[-8:], y[-8:])
    return {"weights": _weights(model), "resumed": _weights(resumed),
            "steps": resumed.optimizer.hvd_compress_state.state_dict()["steps"]}


def trace_and_resume(specs: list[str], batches: int = 3) -> dict[str, Any]:
    """Per scheme: the tape's weights after each step eagerly and under ``tf.function``;
    resuming from a checkpoint (tape with ``tf.train.Checkpoint``, Keras wrapper with
    ``tf.train.Checkpoint`` and with a Keras weights file) against not stopping. Each rank
    checkpoints its own state. Also what XLA compilation does."""
    out: dict[str, Any] = {}
    with horovod_tf(), tempfile.TemporaryDirectory() as tmp:
        x, y = _data(batches)
        tf_batches = [(tf.constant(x[8 * i:8 * (i + 1)]), tf.constant(y[8 * i:8 * (i + 1)]))
                      for i in range(batches)]
        for spec in specs:
            directory = Path(tmp) / spec.replace(":", "_")
            directory.mkdir()
            out[spec] = {"eager": _tape_run(spec, tf_batches, traced=False),
                         "function": _tape_run(spec, tf_batches, traced=True,
                                               checkpoint_dir=directory),
                         "keras_checkpoint": _keras_resume(spec, x, y, directory, "tf"),
                         "keras_file": _keras_resume(spec, x, y, directory, "keras")}
        model = _model(seed=1)
        _compile(model, "onebit", jit_compile=True)
        try:
            model.train_on_batch(x[:8], y[:8])
            out["xla"] = None
        except XLACompileError as exc:
            out["xla"] = str(exc)
    return out


def digits(specs: list[str], epochs: int, ps: str | None = None) -> dict[str, float]:
    """Keras test accuracy on scikit-learn's digits after ``epochs`` epochs, per scheme;
    ``ps``: the optimizer's parameter servers."""
    from examples.digits_keras import train

    with horovod_tf():
        return {spec: train(spec, epochs=epochs, ps=ps).test_accuracy for spec in specs}
