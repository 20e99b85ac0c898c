"""The pipeline behind the TensorFlow binding: TensorFlow gradients in, aggregates out.

Gradients reach the torch schemes through DLPack (:mod:`hvd_compress.tensorflow.comm`) and
run through the same :class:`~hvd_compress.pipeline.Pipeline` as the PyTorch binding, so
each algorithm exists once. In eager mode the exchange runs at once; inside a
``tf.function`` it runs as one ``tf.py_function`` per step, which executes eagerly at run
time. XLA cannot compile a ``py_function``: building the exchange inside a function
compiled with ``jit_compile=True`` (or a Keras model compiled with it) raises
:class:`XLACompileError` at trace time, before anything runs.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf
import torch
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util

from hvd_compress.binding import check_horovod_arguments, resolve_compression, resolve_ps
from hvd_compress.comm.ps_client import check_timeout
from hvd_compress.hierarchy import HierarchicalPipeline, check_hierarchy, horovod_pipeline
from hvd_compress.pipeline import DEFAULT_REPORT_EVERY, Pipeline, StepStats
from hvd_compress.policy import Policy
from hvd_compress.schemes.base import Scheme
from hvd_compress.schemes.dense import NoCompression
from hvd_compress.stats import StatsLogger
from hvd_compress.tensorflow.comm import HorovodTFCommunicator, to_tf, to_torch
from hvd_compress.tensorflow.servers import broadcast_session, with_servers

STATE_KEY = "hvd_compress"


class XLACompileError(RuntimeError):
    """The exchange was traced inside an XLA-compiled function, which cannot run it."""


def check_not_xla() -> None:
    """Raise :class:`XLACompileError` when tracing under ``jit_compile=True``."""
    if control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()):
        raise XLACompileError(
            "hvd_compress cannot run inside an XLA-compiled function: its schemes run in torch "
            "through tf.py_function, which XLA cannot compile. Compile the training step "
            "without XLA: model.compile(..., jit_compile=False), or tf.function without "
            "jit_compile=True.")


def tensor_name(position: int) -> str:
    """The name of the gradient of the variable at ``position`` in the list being exchanged
    (the tape's sources, or the Keras optimizer's variable index).

    It keys the residuals and scheme state, names the collectives and seeds the random
    streams. Positions are used rather than variable names because Keras numbers its layers
    per process (``dense_3/kernel`` in a model rebuilt to resume from a checkpoint was
    ``dense/kernel`` before): every rank and every rebuild of the model agrees on positions.
    """
    return f"var.{position}"


def check_arguments(compression: Any, op: Any, gradient_predivide_factor: float,
                    groups: Any, num_groups: int, **horovod_arguments: Any) -> Scheme:
    """The scheme for ``compression=`` of the tape or the Keras optimizer, once Horovod's
    arguments are checked, as the PyTorch optimizer checks its own
    (:func:`~hvd_compress.binding.resolve_compression` with Horovod's TensorFlow
    compressors, :func:`~hvd_compress.binding.check_horovod_arguments`; further keyword
    arguments go to the latter).

    ``None`` is a new ``Compression.none`` object rather than the shared
    ``Compression.none``: the tape keeps its exchange state per compression object, so two
    tapes made with the default and different options (``op``, ``process_set``) do not
    share one exchange.
    """
    scheme = resolve_compression(compression if compression is not None else NoCompression(),
                                 "tensorflow")
    check_horovod_arguments(hvd, op=op, gradient_predivide_factor=gradient_predivide_factor,
                            groups=groups, num_groups=num_groups, **horovod_arguments)
    return scheme


class GradientExchange:
    """One :class:`Pipeline` over Horovod's TensorFlow collectives.

    Args mirror Horovod's: ``op`` (``hvd.Average`` or ``hvd.Sum``),
    ``gradient_predivide_factor``, ``process_set``; ``policy`` and ``seed`` as in
    :class:`~hvd_compress.pipeline.Pipeline`. ``sparse_as_dense`` turns ``tf.IndexedSlices``
    gradients (embeddings) into dense tensors; without it they are refused. ``ps``: the
    parameter servers that sum the sparse schemes' pairs (see
    :func:`~hvd_compress.tensorflow.DistributedGradientTape`); ``None`` reads
    ``$HVD_COMPRESS_PS``, ``""`` means none (:func:`~hvd_compress.binding.resolve_ps`).
    With servers, creating the exchange broadcasts a random session id from rank 0 of the
    process set (a collective: every rank creates its exchange); ``connect_timeout``
    bounds the wait for a gRPC server never reached (seconds > 0, checked here; ``None``
    for ``$HVD_COMPRESS_PS_CONNECT_TIMEOUT``, else 10 s). ``ps`` and ``connect_timeout``
    are checked before that broadcast. ``hierarchy="host"``: two-level compression
    (:class:`~hvd_compress.hierarchy.HierarchicalPipeline` over Horovod's TensorFlow ops on
    a process set per host and per local rank, docs/user-guide.md#two-level-compression);
    creating it is a collective of every rank (run eagerly, also while a ``tf.function``
    is traced), and what cannot run raises ``ValueError`` first
    (:func:`~hvd_compress.hierarchy.check_hierarchy`: ``Compression.auto``, a process set
    other than the global one, ``ps="mpi"``, horovodrun's elastic mode).
    """

    def __init__(self, compression: Scheme, op: Any = hvd.Average,
                 gradient_predivide_factor: float = 1.0, process_set: Any = None,
                 policy: Policy | None = None, seed: int = 0,
                 sparse_as_dense: bool = False, ps: str | None = None,
                 connect_timeout: float | None = None,
                 report_every: int = DEFAULT_REPORT_EVERY, hierarchy: str | None = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.options = self.normalize(
            {"op": op, "gradient_predivide_factor": gradient_predivide_factor,
             "process_set": self.process_set, "policy": policy, "seed": seed,
             "sparse_as_dense": sparse_as_dense, "ps": ps, "connect_timeout": connect_timeout,
             "report_every": report_every, "hierarchy": hierarchy})
        self.ps = self.options["ps"]
        self.sparse_as_dense = sparse_as_dense
        check_hierarchy(hierarchy, compression, ps=self.ps, process_set=self.process_set,
                        global_set=hvd.global_process_set)
        options = dict(average=(op == hvd.Average), prescale=gradient_predivide_factor,
                       seed=seed, report_every=report_every)
        self.pipeline: Pipeline | HierarchicalPipeline
        if hierarchy is None:
            comm = with_servers(HorovodTFCommunicator(self.process_set), self.ps,
                                self.process_set, self.options["connect_timeout"])
            self.pipeline = Pipeline(compression, comm, policy, **options)
        else:
            with tf.init_scope():  # collectives now, even while a step is being traced
                session = broadcast_session(self.process_set) if self.ps else None
                self.pipeline = horovod_pipeline(
                    hvd, compression, policy, self.ps, session,
                    self.options["connect_timeout"], communicator=HorovodTFCommunicator,
                    **options)
        self.steps = 0  # completed exchanges
        self.stats_logger: StatsLogger | None = None  # called after each (see keras.py)

    @staticmethod
    def normalize(options: dict[str, Any]) -> dict[str, Any]:
        """Options as compared between two uses of one compression object."""
        process_set = options.get("process_set")
        process_set = process_set if process_set is not None else hvd.global_process_set
        return {**options, "process_set": process_set.process_set_id,
                "ps": resolve_ps(options.get("ps")),
                "connect_timeout": check_timeout(options.get("connect_timeout"),
                                                 "connect_timeout"),
                "report_every": options.get("report_every", DEFAULT_REPORT_EVERY),
                "hierarchy": options.get("hierarchy")}

    def reduce(self, names: Sequence[str], grads: Sequence[Any]) -> list[Any]:
        """Aggregate ``grads`` (``None`` entries pass through); eager or traced."""
        present = [i for i, g in enumerate(grads) if g is not None]
        tensors = [self._dense(names[i], grads[i]) for i in present]
        if not tensors:
            return list(grads)
        keys = [names[i] for i in present]
        if tf.executing_eagerly():
            reduced = self._reduce_now(keys, *tensors)
        else:
            check_not_xla()
            reduced = tf.py_function(lambda *xs: self._reduce_now(keys, *xs), tensors,
                                     Tout=[t.dtype for t in tensors],
                                     name="hvd_compress_exchange")
            for out, tensor in zip(reduced, tensors):
                out.set_shape(tensor.shape)
        result = list(grads)
        for i, out in zip(present, reduced):
            result[i] = out
        return result

    def _dense(self, name: str, grad: Any) -> tf.Tensor:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise TypeError(f"the gradient of {name!r} is a tf.IndexedSlices (an embedding "
                                "lookup); hvd_compress compresses dense gradients: pass "
                                "sparse_as_dense=True")
        return tf.convert_to_tensor(grad)

    def _reduce_now(self, names: Sequence[str], *tensors: tf.Tensor) -> list[tf.Tensor]:
        results = self.pipeline.reduce({n: to_torch(t) for n, t in zip(names, tensors)})
        self.steps += 1
        if self.stats_logger is not None:
            self.stats_logger(self.steps, self.pipeline.last_step, self.pipeline.total)
        return [to_tf(results[n]) for n in names]

    @property
    def last_step(self) -> StepStats:
        return self.pipeline.last_step

    @property
    def compression_feedback(self) -> dict[str, Any]:
        """Per compressed tensor, its last measured step on this rank
        (:meth:`hvd_compress.feedback.ErrorFeedback.report`: compression error, residual
        norm and growth, density), as the optimizers' ``compression_feedback``."""
        return self.pipeline.feedback.report()

    @property
    def total(self) -> StepStats:
        return self.pipeline.total


class CompressionState(tf.train.experimental.PythonState):
    """The exchange state of one compression object, as a checkpointable object.

    Holds the pipeline's residuals, scheme state (PowerSGD's ``Q``, DGC's momentum) and step
    counters; ``tf.train.Checkpoint`` saves it as one string and restores it exactly. The
    state is this rank's own (error-feedback residuals differ between ranks): for an exact
    resume every rank saves and restores its own checkpoint. A state restored before the
    first step is applied when the exchange is created.
    """

    def __init__(self, compression: Scheme) -> None:
        self.compression = compression
        self.exchange: GradientExchange | None = None
        self._restored: dict[str, Any] | None = None

    def exchange_for(self, **options: Any) -> GradientExchange:
        """The exchange with these :class:`GradientExchange` options, created on first use
        (loading a state restored before it existed)."""
        if self.exchange is None:
            exchange = GradientExchange(self.compression, **options)
            if self._restored is not None:
                exchange.pipeline.load_state_dict(self._restored)
                self._restored = None
            self.exchange = exchange
        elif self.exchange.options != GradientExchange.normalize(options):
            raise ValueError(
                f"{self.compression!r} is already used with other options "
                f"({self.exchange.options}); the compression object carries the exchange "
                "state from step to step, so give each configuration its own compression "
                "object")
        return self.exchange

    @property
    def compression_feedback(self) -> dict[str, Any]:
        """:attr:`GradientExchange.compression_feedback` of this compression object's
        exchange; empty before its first use."""
        return {} if self.exchange is None else self.exchange.compression_feedback

    def state_dict(self) -> dict[str, Any]:
        if self.exchange is not None:
            return self.exchange.pipeline.state_dict()
        return dict(self._restored or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.exchange is not None:
            self.exchange.pipeline.load_state_dict(state)
        else:
            self._restored = state

    def serialize(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        return buffer.getvalue()

    def deserialize(self, string_value: bytes) -> None:
        self.load_state_dict(torch.load(io.BytesIO(string_value), weights_only=True))


_states: weakref.WeakKeyDictionary[Scheme, CompressionState] = weakref.WeakKeyDictionary()


def compression_state(compression: Scheme) -> CompressionState:
    """The checkpointable exchange state that ``DistributedGradientTape`` keeps for
    ``compression``: ``tf.train.Checkpoint(model=..., optimizer=...,
    compression=compression_state(compression))``."""
    state = _states.get(compression)
    if state is None:
        state = _states[compression] = CompressionState(compression)
    return state
