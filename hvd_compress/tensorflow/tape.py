"""``DistributedGradientTape``: Horovod's TensorFlow tape, with any scheme."""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress.pipeline import DEFAULT_REPORT_EVERY
from hvd_compress.policy import Policy
from hvd_compress.tensorflow.exchange import (
    GradientExchange,
    check_arguments,
    compression_state,
    tensor_name,
)


class _DistributedGradientTape(tf.GradientTape):
    """Methods mixed into the user's tape class (see :func:`DistributedGradientTape`)."""

    def __init__(self, tape: Any, exchange: GradientExchange, persistent: bool,
                 watch_accessed_variables: bool, scale_local_gradients: bool) -> None:
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        self._exchange = exchange
        self._scale_local_gradients = scale_local_gradients
        self._local_sources: set[int] = set()

    @property
    def compression_feedback(self) -> dict[str, Any]:
        """Per compressed tensor, its last measured step on this rank, as the optimizers'
        ``compression_feedback`` (the state of the ``compression`` object, so it covers
        the steps of earlier tapes too; also ``compression_state(compression)
        .compression_feedback``)."""
        return self._exchange.compression_feedback

    def register_local_source(self, source: tf.Variable) -> None:
        """Keep this variable's gradient local (no exchange), as in Horovod."""
        self._local_sources.add(id(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The gradients of ``target``, exchanged with the compression scheme and averaged
        (or summed) over the process set; same structure as ``sources``."""
        flat_sources = tf.nest.flatten(sources)
        grads = super(self.__class__, self).gradient(target, flat_sources, output_gradients,
                                                     unconnected_gradients)
        shared = [i for i, s in enumerate(flat_sources) if id(s) not in self._local_sources]
        reduced = self._exchange.reduce([tensor_name(i) for i in shared],
                                        [grads[i] for i in shared])
        result = list(grads)
        for i, grad in zip(shared, reduced):
            result[i] = grad
        if self._scale_local_gradients and len(shared) < len(result):
            size = self._exchange.process_set.size()
            for i, source in enumerate(flat_sources):
                if id(source) in self._local_sources and result[i] is not None:
                    result[i] = _scaled(result[i], 1.0 / size)
        return tf.nest.pack_sequence_as(sources, result)


def _scaled(grad: Any, factor: float) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    op: Any = hvd.Average,
    gradient_predivide_factor: float = 1.0,
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
) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged over all ranks and
    exchanged with ``compression``: a scheme of :class:`hvd_compress.Compression` (default
    ``Compression.none``), or Horovod's own ``hvd.Compression.none``/``hvd.Compression.fp16``
    of ``horovod.tensorflow``, which mean ``Compression.none``/``Compression.fp16`` (as on
    the PyTorch optimizer; anything else raises ``TypeError`` saying what to pass).

    The arguments and their meaning are those of ``horovod.tensorflow.DistributedGradientTape``
    (``op`` is ``hvd.Average`` or ``hvd.Sum``; ``gradient_predivide_factor`` divides before
    the sum and multiplies after; ``register_local_source`` keeps a variable's gradient
    local, divided by the size if ``scale_local_gradients``). ``device_dense`` and
    ``device_sparse`` are accepted for compatibility: the exchange runs where the gradients
    are. Works eagerly and inside ``tf.function``; not under XLA (``jit_compile=True``
    raises :class:`~hvd_compress.tensorflow.XLACompileError` when traced, see
    :mod:`hvd_compress.tensorflow.exchange`).

    The exchange state (error-feedback residuals, PowerSGD's ``Q``, step counters) belongs to
    the ``compression`` object, which lives across steps while a tape is made per step:
    create the scheme once, outside the training step, use it for one list of sources (the
    state is keyed by position in that list), and checkpoint it with
    ``compression_state(compression)``.

    Additional keyword arguments:
        policy: which tensors are compressed (:class:`hvd_compress.Policy`).
        seed: base of the schemes' random streams; the same on every rank.
        ps: parameter servers (``python -m ps_server``) that sum the sparse schemes' pairs
            (top-k, DGC), as in :func:`hvd_compress.torch.DistributedOptimizer`:
            ``"grpc://host:7070,host:7071"`` (one address per shard, ``grpcs://`` for TLS
            with the CA file in ``$HVD_COMPRESS_PS_CA``), or ``"mpi"`` for servers in the
            same MPMD ``mpirun`` (start Horovod with :func:`hvd_compress.tensorflow.init`).
            Defaults to ``$HVD_COMPRESS_PS``; with neither (or ``ps=""``), sparse pairs are
            summed by Horovod ``allgather`` (same frames, same sums). Every other collective
            goes through Horovod either way. The token is read from
            ``$HVD_COMPRESS_PS_TOKEN``. The session id on the servers is broadcast from rank
            0 when the ``compression`` object is first used (also when that happens while a
            ``tf.function`` is traced), so one compression object serves one ``ps``.
            The syntax of ``ps`` is checked here (``ValueError`` naming a bad address).
        connect_timeout: seconds to wait for a gRPC server that does not answer at all
            before the step fails with a ``PSError`` naming it (default
            ``$HVD_COMPRESS_PS_CONNECT_TIMEOUT``, else 10 s); a value that is not > 0
            raises ``ValueError`` here. Failures after a server has answered are retried
            for ``$HVD_COMPRESS_PS_RETRY_TIMEOUT`` (60 s).
        hierarchy: ``None`` (default): every rank compresses and exchanges with every
            other. ``"host"``: two-level compression, as on the PyTorch optimizer: the
            ranks of a host sum their gradients dense (a reduce-scatter), each local rank
            compresses its piece across hosts (row blocks for schemes marked
            ``sliceable``, whole tensors for PowerSGD), and the host all-gathers the
            result (:mod:`hvd_compress.hierarchy`,
            docs/user-guide.md#two-level-compression). The ``compression`` object's state
            is then this rank's pieces'. Needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or the
            process sets registered at ``hvd.init``) and the global process set; making
            the tape the first time is a collective of every rank. ``Compression.auto``,
            ``ps="mpi"`` and horovodrun's elastic mode raise ``ValueError``.
        report_every: how often ``tape.compression_feedback`` measures the compression
            error of a tensor without error feedback (fp16, TernGrad, QSGD, the vote):
            every ``report_every``-th step (default 10; 1: every step; 0: never), as on the
            PyTorch optimizer. Tensors with error feedback and DGC's velocity are measured
            at every step.

    ``groups``/``num_groups`` and ``op=hvd.Adasum`` raise ``ValueError``.
    """
    del device_dense, device_sparse  # the exchange runs on the gradients' own device
    compression = check_arguments(compression, op, gradient_predivide_factor, groups,
                                  num_groups)
    exchange = compression_state(compression).exchange_for(
        op=op, gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
        policy=policy, seed=seed, sparse_as_dense=sparse_as_dense, ps=ps,
        connect_timeout=connect_timeout, report_every=report_every, hierarchy=hierarchy)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_DistributedGradientTape.__dict__))
    return cls(gradtape._tape, exchange, gradtape._persistent,
               gradtape._watch_accessed_variables, scale_local_gradients)
