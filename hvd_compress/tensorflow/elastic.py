"""Elastic training with Keras 3: the compression state in Horovod's elastic state.

:class:`KerasState` is ``hvd.elastic.KerasState`` (Horovod's
``horovod.tensorflow.elastic.TensorFlowKerasState``) for a Keras 3 model and a
:func:`hvd_compress.tensorflow.keras.DistributedOptimizer`::

    import horovod.tensorflow as hvd
    from hvd_compress.tensorflow.elastic import KerasState, run

    state = KerasState(model, optimizer, step=0)

    @run
    def train(state):
        while state.step < steps:
            ...  # tape, optimizer.apply(grads, model.trainable_variables)
            state.step += 1
            if state.step % 5 == 0:
                state.commit()

Horovod 0.28.1's own Keras state cannot hold a Keras 3 model (it calls
``optimizer.variables()``, a list in Keras 3, and its variable broadcast fails on Keras 3
variables); this one saves and broadcasts ``model.variables`` and ``optimizer.variables``
itself (:func:`hvd_compress.tensorflow.broadcast_variables`).

``commit()`` saves the model, the optimizer's variables and the compression state (the
pipeline's residuals, PowerSGD's ``P`` and ``Q``, DGC's velocity, step counters);
``restore()`` (after a failure) brings them back; ``sync()`` (after a reset) gives every
rank rank 0's model, optimizer variables and shared scheme state, rewires the exchange to
Horovod's new ranks (a new parameter-server session per reset) and lets
``Compression.auto`` decide its routes for the new world. What each kind of compression
state does at a resize is :mod:`hvd_compress.elastic`'s policy, the same as the PyTorch
binding's (docs/elastic.md). 1-bit Adam
(:class:`hvd_compress.tensorflow.keras.OneBitAdam`) keeps its frozen variance in its own
Keras variables, which this state saves, restores and broadcasts with the optimizer's.
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import torch
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.tensorflow.elastic import run

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect
from hvd_compress.elastic import ElasticCompression, check_elastic_wiring, close_communicator
from hvd_compress.pipeline import Pipeline
from hvd_compress.tensorflow.broadcast import broadcast_variables
from hvd_compress.tensorflow.comm import HorovodTFCommunicator
from hvd_compress.tensorflow.exchange import GradientExchange, tensor_name

__all__ = ["KerasCompression", "KerasState", "run"]


class KerasCompression(ElasticCompression):
    """:class:`~hvd_compress.elastic.ElasticCompression` for the exchange of a
    :func:`hvd_compress.tensorflow.keras.DistributedOptimizer` (built). Refuses
    ``ps="mpi"`` with a ``ValueError`` saying what to use."""

    def __init__(self, optimizer: Any, pool_on_commit: bool = False,
                 ps_workers: int | None = None) -> None:
        exchange = getattr(getattr(optimizer, "hvd_compress_state", None), "exchange", None)
        if not isinstance(exchange, GradientExchange):
            raise TypeError("KerasCompression takes a "
                            "hvd_compress.tensorflow.keras.DistributedOptimizer")
        check_elastic_wiring("horovod", exchange.ps)
        super().__init__(pool_on_commit, ps_workers)
        self.optimizer = optimizer
        self.exchange = exchange
        self.snapshot()

    @property
    def pipeline(self) -> Pipeline:
        return self.exchange.pipeline

    def shapes(self) -> dict[str, torch.Size]:
        opt = self.optimizer
        local = getattr(opt, "_hvdc_local", set())
        return {tensor_name(opt._get_variable_index(v)): torch.Size(v.shape)
                for v in opt._trainable_variables if id(v) not in local}

    def broadcast_object(self, obj: Any) -> Any:
        return hvd.broadcast_object(obj, root_rank=0, name="hvdc.elastic.sync")

    def communicator(self, session: str) -> Communicator:
        exchange = self.exchange
        close_communicator(exchange.pipeline.comm)
        dense = HorovodTFCommunicator(exchange.process_set)
        if not exchange.ps:
            return dense
        timeout = exchange.options["connect_timeout"]
        comm = ParameterServerCommunicator(
            dense, connect(exchange.ps, dense.rank, workers=self.ps_workers,
                           connect_timeout=timeout), session)
        return self.stand_ins(comm, exchange.ps, timeout)

    def rewire(self) -> Communicator:
        """The exchange on Horovod's current ranks; OneBitAdam's warm-up exchange too."""
        warmup = getattr(self.optimizer, "_warmup", None)
        if isinstance(warmup, GradientExchange):
            warmup.pipeline.comm = warmup.pipeline.routes.comm = \
                HorovodTFCommunicator(warmup.process_set)
        return super().rewire()

    def snapshot(self) -> None:
        self._saved = self.pipeline.state_dict()

    def restore(self) -> None:
        """Back to the last commit's compression state, chunk residuals folded."""
        self.discard_step()
        self.pipeline.load_state_dict(self._saved)
        self.after_restore()


class KerasState(ObjectState):
    """Horovod's elastic state for a built Keras 3 ``model`` and its ``optimizer``
    (default ``model.optimizer``); keyword arguments are further values to keep, exposed
    as attributes, as in Horovod. With a :func:`hvd_compress.tensorflow.keras.
    DistributedOptimizer` its compression state is kept across resets (module docstring);
    ``pool_on_commit`` and ``ps_workers`` as for
    :class:`hvd_compress.torch.elastic.TorchState`. Train in a function decorated with
    :func:`run` (``horovod.tensorflow.elastic.run``)."""

    def __init__(self, model: keras.Model, optimizer: Any = None, *,
                 pool_on_commit: bool = False, ps_workers: int | None = None,
                 **kwargs: Any) -> None:
        if not model.built:
            raise ValueError("the model must be built first: call it on a batch or "
                             "model.build(input_shape)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        if self.optimizer is None:
            raise ValueError("pass the optimizer, or compile the model with it")
        if not self.optimizer.built:  # its variables must exist to be saved and broadcast
            self.optimizer.build(model.trainable_variables)
        self.compression = (KerasCompression(self.optimizer, pool_on_commit, ps_workers)
                            if hasattr(self.optimizer, "hvd_compress_state") else None)
        self._save_model()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    def _variables(self) -> list[Any]:
        return [*self.model.variables, *self.optimizer.variables]

    def _save_model(self) -> None:
        self._saved_variables = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def save(self) -> None:
        self._save_model()
        if self.compression is not None:
            self.compression.save()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self._variables(), self._saved_variables):
            variable.assign(value)
        if self.compression is not None:
            self.compression.restore()
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        if self.compression is not None:
            self.compression.sync()
        self._save_model()
        super().sync()

    def check_host_updates(self) -> None:
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt as interrupt:
            if self.compression is not None:
                self.compression.before_resize(interrupt.skip_sync)
            raise

    def on_reset(self) -> None:
        if self.compression is not None:
            self.compression.on_reset()
        super().on_reset()
