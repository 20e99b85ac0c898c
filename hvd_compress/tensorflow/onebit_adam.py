"""Keras 3 ``OneBitAdam``: Adam whose momentum, not its gradient, travels with 1-bit compression.

The Keras counterpart of :class:`hvd_compress.torch.OneBitAdam` (1-bit Adam: Tang et al.
2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML), with the same two stages, hyper-parameters and defaults:

1. **Warm-up** (the first ``freeze_step`` steps): gradients averaged over the process set by
   an uncompressed all-reduce, then Keras' own ``Adam`` update (this class is a
   ``keras.optimizers.Adam``), so until ``freeze_step`` a run is bit for bit Keras Adam on
   Horovod-averaged gradients.
2. **Compression** (every later step): the second moment ``v`` stays frozen at its value
   after ``freeze_step`` steps; each rank updates the momentum with its own gradient and
   the ranks average it, in the frozen preconditioner's units, with the compressed
   all-reduce of the packed schemes (error feedback on the worker and the reducing side)::

       m_local = beta_1 * m + (1 - beta_1) * (g_local + weight_decay * w)
       d       = sqrt(v / (1 - beta_2^freeze_step)) + epsilon
       u_local = clip(m_local / d, -B, B),  B = max(1, (1 - beta_1) / sqrt(1 - beta_2))
       u       = mean over ranks of u_local, 1-bit compressed with error feedback
       u       = 0 where v == 0 (no gradient in the whole warm-up: the element stays put)
       m       = u * d;   w -= learning_rate / (1 - beta_1^t) * u

The module docstring of :mod:`hvd_compress.torch.onebit_adam` gives the reasons for the
preconditioner's units, the clip and the mask. The codec and the compressed all-reduce are
the shared torch ones (:mod:`hvd_compress.schemes.onebit`,
:mod:`hvd_compress.schemes.packed`), reached through
:class:`~hvd_compress.tensorflow.exchange.GradientExchange`; the element-wise lines above
are TensorFlow ops on the Keras slots, so a step traces into ``model.fit``'s graph (the
exchange is its one ``tf.py_function``) and ``tf.cond`` on ``iterations`` picks the stage,
the same on every rank.

Invariant: the compressed stage's update is :class:`hvd_compress.torch.OneBitAdam`'s to
float32 rounding, with the same bytes on the wire (see docs/benchmarks.md#convergence for
the accuracy runs). Keras' Adam adds ``epsilon`` to ``sqrt(v)`` and torch's to
``sqrt(v / (1 - beta_2^t))``; the compressed stage uses torch's (the formula above), which
differs from the warm-up's only where ``v`` is of the order of ``epsilon^2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvd_compress.binding import resolve_compression
from hvd_compress.compression import Compression
from hvd_compress.pipeline import StepStats
from hvd_compress.policy import Policy
from hvd_compress.schemes.dense import NoCompression
from hvd_compress.stats import CompressionStats
from hvd_compress.tensorflow.exchange import CompressionState, GradientExchange, tensor_name

STATE_KEY = "hvd_compress_onebit_adam"
"""Key of this optimizer's compression state in Keras weight files."""

_UNSUPPORTED = {
    "amsgrad": "its frozen variance and compressed momentum replace Adam's own update",
    "clipnorm": "the compressed stage exchanges the momentum, not the gradient; clip the "
                "gradients before apply() instead",
    "clipvalue": "the compressed stage exchanges the momentum, not the gradient; clip the "
                 "gradients before apply() instead",
    "global_clipnorm": "the compressed stage exchanges the momentum, not the gradient; clip "
                       "the gradients before apply() instead",
    "use_ema": "the compressed stage does not maintain Keras' moving average of the weights",
    "gradient_accumulation_steps": "every call exchanges; accumulate the gradients yourself "
                                   "and call apply() once per accumulated step",
    "loss_scale_factor": "unscale the gradients before apply(), or use "
                         "keras.mixed_precision.LossScaleOptimizer's unscaled gradients",
}
"""Keras optimizer options refused at construction, and why."""


def _check_freeze_step(freeze_step: Any) -> int:
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int | np.integer) \
            or freeze_step < 1:
        raise ValueError(f"OneBitAdam: freeze_step must be an integer >= 1 (the warm-up steps "
                         f"whose second moment is frozen), got {freeze_step!r}")
    return int(freeze_step)


@keras.saving.register_keras_serializable(package="hvd_compress")
class OneBitAdam(keras.optimizers.Adam):
    """Keras 3 Adam with 1-bit compressed momentum after a warm-up (the module docstring).

    Make it on every rank after ``horovod.tensorflow.init()`` (or
    :func:`hvd_compress.tensorflow.init`) and pass it to ``model.compile``, or call
    ``apply(grads, variables)`` / ``apply_gradients`` on every rank, with the same variables
    in the same order. It exchanges itself: do not wrap it in ``DistributedOptimizer``.

    Args:
        learning_rate: a float or a Keras learning-rate schedule. Default 1e-3.
        beta_1: Adam's decay rate of the first moment. Default 0.9.
        beta_2: Adam's decay rate of the second moment. Default 0.999.
        epsilon: added to the preconditioner's square root. Default 1e-8, torch's and
            the paper's (Keras' own Adam defaults to 1e-7).
        weight_decay: L2 weight decay added to the gradient, as ``torch.optim.Adam``'s
            ``weight_decay`` and :class:`hvd_compress.torch.OneBitAdam`'s (not Keras'
            decoupled weight decay). Default 0.
        freeze_step: warm-up steps of Adam on uncompressed averaged gradients before the
            variance is frozen and the momentum compressed; at least 1. Default 100000
            (DeepSpeed's and the torch class's); set it to about 15-25% of the run's steps.
        compression: the packed scheme with error feedback that carries the momentum.
            Default ``Compression.onebit()`` (1 bit per element and one float32 scale per
            2048, 31.5x less than float32).
        policy: which tensors are compressed (default :class:`hvd_compress.Policy`: at
            least 1024 elements and two dimensions; the others' momentum is averaged
            exactly).
        process_set: the Horovod process set that trains together. Default all ranks.
        seed: base of the schemes' random streams, the same on every rank. Default 0.
        name: the optimizer's name. Default ``"OneBitAdam"``.
        **keras_options: further Keras optimizer arguments (``ema_momentum`` and the
            like are accepted and unused).

    Raises ``ValueError`` at construction for a ``freeze_step`` that is not an integer
    >= 1, a negative ``learning_rate``, ``epsilon`` or ``weight_decay``, betas outside
    [0, 1), a compression scheme without error feedback, and for the Keras options that
    the compressed stage cannot honour (``amsgrad``, gradient clipping, ``use_ema``,
    ``gradient_accumulation_steps``, ``loss_scale_factor``; the message says what to do);
    ``TypeError`` for a ``compression`` that is not a scheme (as ``DistributedOptimizer``).

    Variables whose gradient is ``None`` are skipped in both stages, as Keras skips them.
    ``tf.IndexedSlices`` gradients (embeddings) are made dense: the momentum is dense.
    The compression state (worker and reducing-side residuals) is this rank's own; it is
    saved in Keras weight files and by ``tf.train.Checkpoint(optimizer=...)`` (attribute
    ``hvd_compress_state``) with the Keras slots, so a checkpoint taken mid-compression
    resumes to the same next step when every rank restores its own. Not usable under XLA:
    compile the model with ``jit_compile=False`` (the exchange raises
    :class:`~hvd_compress.tensorflow.XLACompileError` when traced under XLA).
    """

    averages_across_ranks = True  # DistributedOptimizer refuses to wrap it (binding.py)

    def __init__(self, learning_rate: Any = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-8, weight_decay: float = 0.0, *,
                 freeze_step: int = 100_000, compression: Any = None,
                 policy: Policy | None = None, process_set: Any = hvd.global_process_set,
                 seed: int = 0, name: str = "OneBitAdam", **keras_options: Any) -> None:
        for option, reason in _UNSUPPORTED.items():
            if keras_options.get(option):
                raise ValueError(f"OneBitAdam does not support {option}="
                                 f"{keras_options[option]!r}: {reason}")
        freeze_step = _check_freeze_step(freeze_step)
        for label, value, low, high in (("beta_1", beta_1, 0.0, 1.0),
                                        ("beta_2", beta_2, 0.0, 1.0),
                                        ("epsilon", epsilon, 0.0, None),
                                        ("weight_decay", weight_decay, 0.0, None)):
            if not isinstance(value, int | float) or not (
                    value >= low and (high is None or value < high)):
                bound = f"in [{low}, {high})" if high is not None else f">= {low}"
                raise ValueError(f"OneBitAdam: {label} must be a number {bound}, got {value!r}")
        if isinstance(learning_rate, int | float) and not learning_rate >= 0:
            raise ValueError(f"OneBitAdam: learning_rate must be >= 0, got {learning_rate!r}")
        compression = resolve_compression(
            compression if compression is not None else Compression.onebit(), "tensorflow")
        if not compression.error_feedback:
            raise ValueError(f"OneBitAdam needs a compression scheme with error feedback "
                             f"(Compression.onebit()), got {compression!r}")
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, name=name, **keras_options)
        self.freeze_step = freeze_step
        self.l2_weight_decay = float(weight_decay)
        self.seed = seed
        options = {"process_set": process_set, "policy": policy, "seed": seed,
                   "sparse_as_dense": True}
        self._warmup = GradientExchange(NoCompression(), **options)
        compressed = GradientExchange(compression, **options)
        # An attribute holding a trackable: tf.train.Checkpoint(optimizer=...) saves it.
        self.hvd_compress_state = CompressionState(compression)
        self.hvd_compress_state.exchange = compressed

    @property
    def _compressed(self) -> GradientExchange:
        exchange = self.hvd_compress_state.exchange
        assert exchange is not None
        return exchange

    @property
    def frozen(self) -> bool:
        """Whether the next step compresses (the warm-up is over); eager only."""
        return int(self.iterations.numpy()) >= self.freeze_step

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """One step on every rank: the warm-up's averaged Adam update before
        ``freeze_step`` steps, the compressed momentum's update after."""
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        grads = list(grads)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        names = [tensor_name(self._get_variable_index(v)) for v in variables]
        tf.cond(self.iterations >= self.freeze_step,
                lambda: self._compressed_apply(names, grads, variables),
                lambda: self._warmup_apply(names, grads, variables))

    def _warmup_apply(self, names: Sequence[str], grads: list[Any],
                      variables: list[Any]) -> None:
        reduced = self._warmup.reduce(names, grads)
        if self.l2_weight_decay:
            reduced = [g if g is None else g + self.l2_weight_decay * v.value
                       for g, v in zip(reduced, variables)]
        super().apply(reduced, variables)

    def _compressed_apply(self, names: Sequence[str], grads: list[Any],
                          variables: list[Any]) -> None:
        present = [i for i, g in enumerate(grads) if g is not None]
        beta_1, beta_2, eps = float(self.beta_1), float(self.beta_2), float(self.epsilon)
        bound = max(1.0, (1 - beta_1) / (1 - beta_2) ** 0.5)
        frozen_correction = 1 - beta_2 ** self.freeze_step
        local, owned = [], []
        for i in present:
            variable = variables[i]
            index = self._get_variable_index(variable)
            m, v = self._momentums[index], self._velocities[index]
            grad = tf.cast(tf.convert_to_tensor(grads[i]), variable.dtype)
            if self.l2_weight_decay:
                grad = grad + self.l2_weight_decay * variable.value
            denom = tf.sqrt(v.value / frozen_correction) + eps
            moment = m.value * beta_1 + grad * (1 - beta_1)
            local.append(tf.clip_by_value(moment / denom, -bound, bound))
            owned.append((variable, m, v, denom))
        averaged = self._compressed.reduce([names[i] for i in present], local)
        step = tf.cast(self.iterations + 1, tf.float32)
        lr = tf.cast(self.learning_rate, tf.float32) / (1 - tf.pow(beta_1, step))
        for u, (variable, m, v, denom) in zip(averaged, owned):
            u = tf.where(tf.equal(v.value, 0), tf.zeros_like(u), u)
            self.assign(m, u * denom)
            self.assign_sub(variable, u * tf.cast(lr, variable.dtype))
        self._iterations.assign_add(1)

    # Statistics -----------------------------------------------------------------------------
    def _exchanges(self) -> tuple[GradientExchange, GradientExchange]:
        return self._warmup, self._compressed

    @property
    def compression_stats(self) -> CompressionStats:
        """Bytes and time of the last completed step on this rank: the uncompressed
        all-reduce's in the warm-up, the compressed momentum's after (``print()`` it, or
        ``.to_dict()``; :class:`~hvd_compress.stats.CompressionStats`)."""
        exchange = self._compressed if self._compressed.steps else self._warmup
        return CompressionStats.of(exchange.last_step, min(exchange.steps, 1))

    @property
    def compression_totals(self) -> CompressionStats:
        """The same, summed over both stages' steps completed so far on this rank."""
        total = StepStats()
        for exchange in self._exchanges():
            total.add(exchange.total)
        return CompressionStats.of(total, sum(e.steps for e in self._exchanges()))

    # State ----------------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Keras' config with this class's hyper-parameters (``compression``, ``policy``
        and ``process_set`` are not serialised: a rebuilt optimizer has the defaults)."""
        config = super().get_config()
        for option in _UNSUPPORTED:
            config.pop(option, None)
        config.update(weight_decay=self.l2_weight_decay, freeze_step=self.freeze_step,
                      seed=self.seed)
        return config

    def save_own_variables(self, store: Any) -> None:
        """Keras' slots plus this rank's compression state (``.weights.h5``/``.keras``)."""
        super().save_own_variables(store)
        store[STATE_KEY] = np.frombuffer(self.hvd_compress_state.serialize(), np.uint8)

    def load_own_variables(self, store: Any) -> None:
        super().load_own_variables({key: store[key] for key in store.keys()
                                    if key != STATE_KEY})
        if STATE_KEY in store.keys():
            data = np.asarray(store[STATE_KEY], dtype=np.uint8).tobytes()
            self.hvd_compress_state.deserialize(data)

