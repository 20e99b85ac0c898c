"""Keras 3: ``DistributedOptimizer`` with any scheme, and the initial-weights broadcast.

Horovod 0.28.1's own ``horovod.tensorflow.keras.DistributedOptimizer`` does not synchronise
under Keras 3: it hooks ``get_gradients``/``_compute_gradients``/``_aggregate_gradients``,
which Keras 3's ``fit`` never calls, so every rank applies its own gradients without an
error. This wrapper overrides ``apply``, the one method every Keras 3 update goes through
(``fit``, ``train_on_batch`` and ``apply_gradients``).
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np

from hvd_compress.binding import check_wrappable
from hvd_compress.pipeline import DEFAULT_REPORT_EVERY
from hvd_compress.policy import Policy
from hvd_compress.stats import CompressionStats, StatsLogger
from hvd_compress.tensorflow.broadcast import broadcast_variables
from hvd_compress.tensorflow.exchange import (
    STATE_KEY,
    CompressionState,
    GradientExchange,
    check_arguments,
    tensor_name,
)
from hvd_compress.tensorflow.onebit_adam import OneBitAdam


class _DistributedOptimizer(keras.optimizers.Optimizer):
    """Methods mixed into the user's optimizer class (see :func:`DistributedOptimizer`)."""

    def _hvdc_setup(self, exchange: GradientExchange, scale_local_gradients: bool) -> None:
        # An attribute holding a trackable: tf.train.Checkpoint(optimizer=...) saves it.
        self.hvd_compress_state = CompressionState(exchange.pipeline.scheme)
        self.hvd_compress_state.exchange = exchange
        self._hvdc_scale_local = scale_local_gradients
        self._hvdc_local: set[Any] = set()

    def register_local_var(self, var: Any) -> None:
        """Keep this variable's gradient local (no exchange), as in Horovod."""
        self._hvdc_local.add(id(var))

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Exchange ``grads`` over the process set, then apply them with the wrapped
        optimizer's update rule."""
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        grads = list(grads)
        if not self.built:  # as the wrapped apply() would, to know each variable's index
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        exchange = self.hvd_compress_state.exchange
        shared = [i for i, v in enumerate(variables) if id(v) not in self._hvdc_local]
        names = [tensor_name(self._get_variable_index(variables[i])) for i in shared]
        reduced = exchange.reduce(names, [grads[i] for i in shared])
        for i, grad in zip(shared, reduced):
            grads[i] = grad
        if self._hvdc_scale_local and len(shared) < len(grads):
            size = exchange.process_set.size()
            for i, variable in enumerate(variables):
                if id(variable) in self._hvdc_local and grads[i] is not None:
                    grads[i] = grads[i] / size
        return super(self.__class__, self).apply(grads, trainable_variables)

    @property
    def compression_stats(self) -> CompressionStats:
        """Bytes and time of the last completed step on this rank: ``print()`` it for a
        summary, ``.to_dict()`` for a plain dict (see :class:`CompressionStats`)."""
        exchange = self.hvd_compress_state.exchange
        return CompressionStats.of(exchange.last_step, min(exchange.steps, 1))

    @property
    def compression_totals(self) -> CompressionStats:
        """The same, summed over all steps completed so far on this rank."""
        exchange = self.hvd_compress_state.exchange
        return CompressionStats.of(exchange.total, exchange.steps)

    @property
    def compression_feedback(self) -> dict[str, Any]:
        """Per compressed tensor, its last measured step on this rank, as the PyTorch
        optimizer's ``compression_feedback`` (:meth:`hvd_compress.feedback.ErrorFeedback.report`:
        compression error, residual norm and growth, density)."""
        return self.hvd_compress_state.exchange.compression_feedback

    def log_compression_stats(self, to: Any, every: int = 100,
                              prefix: str = "hvd_compress") -> None:
        """After every ``every``-th step, send that step's :attr:`compression_stats` to
        ``to``: a TensorBoard writer with ``add_scalar(tag, value, global_step)`` or a
        callable ``to(step, stats)``; ``None`` stops. As the PyTorch optimizer's (see
        :class:`hvd_compress.stats.StatsLogger`)."""
        self.hvd_compress_state.exchange.stats_logger = (
            None if to is None else StatsLogger(to, every, prefix))

    def save_own_variables(self, store: Any) -> None:
        """The wrapped optimizer's variables plus this rank's compression state (Keras'
        ``.weights.h5`` / ``.keras`` files)."""
        super(self.__class__, self).save_own_variables(store)
        store[STATE_KEY] = np.frombuffer(self.hvd_compress_state.serialize(), np.uint8)

    def load_own_variables(self, store: Any) -> None:
        variables = {key: store[key] for key in store.keys() if key != STATE_KEY}
        super(self.__class__, self).load_own_variables(variables)
        if STATE_KEY in store.keys():
            data = np.asarray(store[STATE_KEY], dtype=np.uint8).tobytes()
            self.hvd_compress_state.deserialize(data)


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = hvd.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = hvd.global_process_set,
    scale_local_gradients: bool = True,
    *,
    policy: Policy | None = None,
    seed: int = 0,
    ps: str | None = None,
    connect_timeout: float | None = None,
    report_every: int = DEFAULT_REPORT_EVERY,
    hierarchy: str | None = None,
) -> keras.optimizers.Optimizer:
    """A Keras 3 optimizer that exchanges gradients with ``compression`` before every update:
    a scheme of :class:`hvd_compress.Compression` (default ``Compression.none``), or
    Horovod's own ``hvd.Compression.none``/``hvd.Compression.fp16`` of ``horovod.tensorflow``,
    which mean ``Compression.none``/``Compression.fp16``, as for the tape.

    The arguments and their meaning are those of
    ``horovod.tensorflow.keras.DistributedOptimizer``; the result is a new optimizer of the
    same class built from ``optimizer.get_config()`` (pass it to ``model.compile``).
    ``register_local_var(v)`` keeps a variable's gradient local. ``device_dense`` /
    ``device_sparse`` are accepted for compatibility (the exchange runs where the gradients
    are). ``backward_passes_per_step`` must be 1: for local accumulation use Keras 3's own
    ``gradient_accumulation_steps`` on the wrapped optimizer (the exchange then runs on every
    micro-batch). ``groups``/``num_groups`` and ``op=hvd.Adasum`` raise ``ValueError``.

    The compression state (this rank's residuals, scheme state, step counters) is saved with
    the optimizer: by ``tf.train.Checkpoint(optimizer=...)`` (attribute
    ``hvd_compress_state``) and in Keras weight files. Not usable under XLA: compile the
    model with ``jit_compile=False`` (Keras' default on CPU; with ``"auto"`` on a GPU the
    first ``fit`` raises :class:`~hvd_compress.tensorflow.XLACompileError`).

    Additional keyword arguments:
        policy: which tensors are compressed (:class:`hvd_compress.Policy`).
        seed: base of the schemes' random streams; the same on every rank.
        ps: parameter servers that sum the sparse schemes' pairs (top-k, DGC), as for
            :func:`hvd_compress.tensorflow.DistributedGradientTape`: ``"grpc://h:p,..."``,
            ``"grpcs://..."`` or ``"mpi"`` (start Horovod with
            :func:`hvd_compress.tensorflow.init`); default ``$HVD_COMPRESS_PS``, ``""`` for
            Horovod ``allgather``. With servers, this call broadcasts a random session id
            from rank 0, so every rank must make the optimizer. The syntax is checked
            first (``ValueError`` naming a bad address).
        connect_timeout: seconds to wait for a gRPC server that does not answer at all
            before the step fails with a ``PSError`` naming it (default
            ``$HVD_COMPRESS_PS_CONNECT_TIMEOUT``, else 10 s); a value that is not > 0
            raises ``ValueError`` here. Failures after a server has answered are retried
            for ``$HVD_COMPRESS_PS_RETRY_TIMEOUT`` (60 s).
        hierarchy: ``None`` (default, flat) or ``"host"``: two-level compression, as for
            :func:`hvd_compress.tensorflow.DistributedGradientTape` (dense inside a host,
            compressed across hosts; docs/user-guide.md#two-level-compression). Needs
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` and the global process set; this call is
            then a collective of every rank.
        report_every: how often :attr:`compression_feedback` measures the compression
            error of a tensor without error feedback: every ``report_every``-th step
            (default 10; 1: every step; 0: never), as on the PyTorch optimizer.

    The scheme checks the wrapped optimizer first (``Scheme.check_optimizer``, as the
    PyTorch wrapper does, on the Keras optimizer's ``momentum`` seen through
    :func:`torch_view`): ``Compression.dgc`` and Signum (``Compression.vote(momentum=...)``)
    refuse an optimizer with momentum of its own (``ValueError``: both momenta would
    compound), 1-bit and random-k warn for momentum of 0.9 or more.
    """
    del device_dense, device_sparse  # the exchange runs on the gradients' own device
    check_wrappable(optimizer)  # not OneBitAdam, which exchanges by itself
    compression = check_arguments(
        compression, op, gradient_predivide_factor, groups, num_groups,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        accumulation="set gradient_accumulation_steps on the wrapped Keras optimizer instead")
    compression.check_optimizer(torch_view(optimizer))
    exchange = GradientExchange(compression, op=op,
                                gradient_predivide_factor=gradient_predivide_factor,
                                process_set=process_set, policy=policy, seed=seed,
                                sparse_as_dense=sparse_as_dense, ps=ps,
                                connect_timeout=connect_timeout,
                                report_every=report_every, hierarchy=hierarchy)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    wrapped._hvdc_setup(exchange, scale_local_gradients)
    return wrapped


def torch_view(optimizer: keras.optimizers.Optimizer) -> Any:
    """What :meth:`Scheme.check_optimizer <hvd_compress.schemes.base.Scheme.check_optimizer>`
    reads of a wrapped optimizer, made from a Keras one: an object of a class with the
    Keras class's name (messages name it) and one ``param_groups`` entry, as a torch
    optimizer has, holding the Keras optimizer's ``momentum``.

    Keras ``SGD`` and ``RMSprop`` have a float ``momentum`` (0 when off), as their torch
    namesakes' parameter groups do; other Keras optimizers have none, which reads as 0, as
    the checks read torch's (Adam's ``beta_1`` is not a ``momentum`` in either framework).
    Keras optimizers of Adam's family (``beta_1`` and ``beta_2``) get ``betas``, as torch's
    Adam, AdamW and the rest have. This is the one place that translates Keras attributes
    for the checks.
    """
    group: dict[str, Any] = {"momentum": float(getattr(optimizer, "momentum", 0.0) or 0.0)}
    if hasattr(optimizer, "beta_1") and hasattr(optimizer, "beta_2"):
        group["betas"] = (float(optimizer.beta_1), float(optimizer.beta_2))
    return type(optimizer.__class__.__name__, (), {"param_groups": [group]})()


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's variables and the optimizer's state from ``root_rank`` when
    training starts, so every rank begins from the same weights.

    Works with Keras 3 models (Horovod 0.28.1's callback and ``hvd.broadcast_variables``
    fail on Keras 3 variables). Runs once, before the first step; the optimizer is built
    first if it has not been, so its slots exist on every rank. Compression state is not
    broadcast: it is each rank's own and starts empty.
    """

    def __init__(self, root_rank: int = 0, process_set: Any = hvd.global_process_set) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.broadcast_done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, self.process_set)
        self.broadcast_done = True


__all__ = ["BroadcastGlobalVariablesCallback", "DistributedOptimizer", "OneBitAdam", "torch_view"]
