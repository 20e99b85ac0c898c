"""Rank-side halves of tests/test_tensorflow_onebit_adam.py: the Keras ``OneBitAdam`` on real
ranks, next to Keras Adam on Horovod-averaged gradients and to the torch ``OneBitAdam``."""

from __future__ import annotations

import tempfile
from typing import Any

import horovod.tensorflow as hvd_tf
import keras
import numpy as np
import tensorflow as tf
import torch

from examples.digits_keras import accuracy, digits_arrays, make_model
from hvd_compress import Compression
from hvd_compress.tensorflow.exchange import tensor_name
from hvd_compress.tensorflow.keras import DistributedOptimizer, OneBitAdam
from hvd_compress.tensorflow.onebit_adam import STATE_KEY
from hvd_compress.torch import OneBitAdam as TorchOneBitAdam
from tests.workers.tf_collectives import horovod_tf

LR, DECAY = 1e-3, 0.01
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _flat(variables: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(v).reshape(-1) for v in variables])


def _gradients(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list[tf.Tensor]:
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    return tape.gradient(loss, model.trainable_variables)


def _stats(stats: Any) -> dict[str, Any]:
    return {"payload_bytes": stats.payload_bytes, "dense_bytes": stats.dense_bytes,
            "compressed_tensors": stats.compressed_tensors,
            "collective_bytes": dict(stats.collective_bytes)}


def _torch_twin(model: keras.Model, optimizer: OneBitAdam) -> tuple[TorchOneBitAdam,
                                                                    list[torch.Tensor]]:
    """The torch ``OneBitAdam`` at the Keras one's state (weights, ``m``, ``v``, step
    count, empty residuals) when it freezes, with the same tensor names."""
    params = [torch.tensor(np.asarray(v), requires_grad=True) for v in model.trainable_variables]
    twin = TorchOneBitAdam(params, lr=LR, weight_decay=DECAY, freeze_step=optimizer.freeze_step,
                           named_parameters=[(tensor_name(i), p) for i, p in enumerate(params)])
    for p, variable in zip(params, model.trainable_variables):
        index = optimizer._get_variable_index(variable)
        twin.state[p] = {"step": torch.tensor(float(optimizer.freeze_step)),
                         "exp_avg": torch.tensor(optimizer._momentums[index].numpy()),
                         "exp_avg_sq": torch.tensor(optimizer._velocities[index].numpy())}
    twin.global_step = optimizer.freeze_step
    return twin, params


def _construction_errors() -> dict[str, str | None]:
    def error(**kwargs: Any) -> str | None:
        try:
            OneBitAdam(**kwargs)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    cases: dict[str, dict[str, Any]] = {
        "freeze_negative": {"freeze_step": -1}, "freeze_zero": {"freeze_step": 0},
        "freeze_float": {"freeze_step": 10.0}, "freeze_bool": {"freeze_step": True},
        "qsgd": {"compression": Compression.qsgd()}, "string": {"compression": "onebit"},
        "amsgrad": {"amsgrad": True}, "clipnorm": {"clipnorm": 1.0},
        "accumulation": {"gradient_accumulation_steps": 2}, "ema": {"use_ema": True},
        "beta_1": {"beta_1": 1.0}, "epsilon": {"epsilon": -1e-8},
        "weight_decay": {"weight_decay": -0.1}, "learning_rate": {"learning_rate": -1.0},
        "defaults": {}}
    errors = {label: error(**kwargs) for label, kwargs in cases.items()}
    try:
        DistributedOptimizer(OneBitAdam(freeze_step=10))
        errors["wrapped"] = None
    except TypeError as exc:
        errors["wrapped"] = str(exc)
    return errors


def parity(freeze_step: int, steps: int) -> dict[str, Any]:
    """Three copies of the digits network from one start on this rank's batches: the Keras
    ``OneBitAdam`` with L2 weight decay ``DECAY`` (weights and momentum after every step,
    its statistics), Keras ``Adam`` (``epsilon=1e-8``) on gradients averaged by Horovod's
    all-reduce plus ``DECAY`` times the weights (torch's L2), and from the freeze on the
    torch ``OneBitAdam`` fed the Keras one's gradients. Then a checkpoint two steps
    into the compressed stage, resumed in a new optimizer; and the construction errors."""
    out: dict[str, Any] = {"onebit": [], "adam": [], "torch": [], "momentum": [],
                           "torch_momentum": [], "stats": [], "torch_stats": []}
    with horovod_tf(), tempfile.TemporaryDirectory() as tmp:
        out["errors"] = _construction_errors()
        x, y = digits_arrays()[:2]
        keras.utils.set_random_seed(0)
        model, reference = make_model(), make_model()
        reference.set_weights(model.get_weights())
        out["initial"] = _flat(model.get_weights())
        onebit = OneBitAdam(learning_rate=LR, weight_decay=DECAY, freeze_step=freeze_step)
        adam = keras.optimizers.Adam(learning_rate=LR, epsilon=1e-8)
        gen = np.random.default_rng(100 + hvd_tf.rank())
        twin: TorchOneBitAdam | None = None
        batches = [gen.integers(0, len(x), 32) for _ in range(steps + 1)]
        checkpoint_at = freeze_step + 2
        for step, idx in enumerate(batches[:steps]):
            if step == freeze_step:
                twin, params = _torch_twin(model, onebit)
            if step == checkpoint_at:
                tf.train.Checkpoint(model=model, optimizer=onebit).write(f"{tmp}/ckpt")
                store: dict[str, Any] = {}
                onebit.save_own_variables(store)
            grads = _gradients(model, x[idx], y[idx])
            if twin is not None:
                for p, g in zip(params, grads):
                    p.grad = torch.tensor(g.numpy())
                twin.step()
                out["torch"].append(_flat([p.detach().numpy() for p in params]))
                out["torch_momentum"].append(_flat([twin.state[p]["exp_avg"].numpy()
                                                    for p in params]))
                out["torch_stats"].append(_stats(twin.compression_stats))
            onebit.apply(grads, model.trainable_variables)
            out["onebit"].append(_flat(model.get_weights()))
            out["momentum"].append(_flat([m.numpy() for m in onebit._momentums]))
            out["stats"].append(_stats(onebit.compression_stats))
            averaged = [hvd_tf.allreduce(g, op=hvd_tf.Average) + DECAY * v
                        for g, v in zip(_gradients(reference, x[idx], y[idx]),
                                        reference.trainable_variables)]
            adam.apply(averaged, reference.trainable_variables)
            out["adam"].append(_flat(reference.get_weights()))
        out["totals_steps"] = onebit.compression_totals.steps
        # Resume: a new model and optimizer, restored, take step checkpoint_at again.
        for how in ("checkpoint", "store", "store_without_residuals"):
            resumed = make_model()
            again = OneBitAdam(learning_rate=LR, weight_decay=DECAY, freeze_step=freeze_step)
            again.build(resumed.trainable_variables)
            if how == "checkpoint":
                tf.train.Checkpoint(model=resumed, optimizer=again).read(
                    f"{tmp}/ckpt").assert_consumed()
            else:
                again.load_own_variables(store if how == "store" else {
                    key: value for key, value in store.items() if key != STATE_KEY})
                tf.train.Checkpoint(model=resumed).read(f"{tmp}/ckpt").expect_partial()
            idx = batches[checkpoint_at]
            again.apply(_gradients(resumed, x[idx], y[idx]), resumed.trainable_variables)
            out[f"resumed_{how}"] = _flat(resumed.get_weights())
    return out


def fit_digits(freeze_step: int, epochs: int) -> dict[str, Any]:
    """``model.fit`` on this rank's half of the digits, with the Keras ``OneBitAdam`` and
    with ``DistributedOptimizer(keras.optimizers.Adam)`` (uncompressed, ``epsilon=1e-8``),
    same seed, epochs and batches: test accuracies, final weights, the 1-bit statistics."""
    out: dict[str, Any] = {}
    with horovod_tf():
        x_train, y_train, x_test, y_test = digits_arrays()
        rank, size = hvd_tf.rank(), hvd_tf.size()
        keep = len(x_train) // size // 32 * 32
        x, y = x_train[rank::size][:keep], y_train[rank::size][:keep]
        for label in ("adam", "onebit"):
            keras.utils.set_random_seed(0)
            model = make_model()
            optimizer = (OneBitAdam(learning_rate=LR, freeze_step=freeze_step)
                         if label == "onebit" else DistributedOptimizer(
                             keras.optimizers.Adam(learning_rate=LR, epsilon=1e-8)))
            model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
            history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
            out[label] = {"accuracy": accuracy(model, x_test, y_test),
                          "loss": float(history.history["loss"][-1]),
                          "weights": _flat(model.get_weights()),
                          "iterations": int(optimizer.iterations.numpy()),
                          "stats": _stats(optimizer.compression_stats)}
        out["steps_per_epoch"] = keep // 32
    return out
