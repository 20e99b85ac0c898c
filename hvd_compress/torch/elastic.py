"""Elastic training: the compression state in Horovod's ``hvd.elastic`` state objects.

:class:`TorchState` is ``hvd.elastic.TorchState`` for a model and a
:func:`hvd_compress.torch.DistributedOptimizer`::

    state = hvd_compress.torch.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state): ...   # state.commit() every few steps, as with Horovod

``commit()`` saves the optimizer's ``state_dict()`` (so its residuals, scheme state and
step counters) with the model; ``restore()`` (after a worker failed) brings them back;
``sync()`` (after a reset) gives every rank rank 0's model, optimizer state and shared
scheme state, and rewires the optimizer to Horovod's new ranks, with a new
parameter-server session per reset.

What happens to each kind of state when the world changes is
:mod:`hvd_compress.elastic`'s policy, shared with the Keras binding
(:mod:`hvd_compress.tensorflow.elastic`): what a rank owes (its error-feedback residual,
DGC's velocity, its chunk residual of the compressed all-reduce) is pooled over the old
world at a resize and shared by the new one, so ``sum of applied aggregates + sum over
ranks of owed = sum of all gradients`` (in the units the ranks submit) holds across it up
to float rounding; PowerSGD's ``P`` and ``Q`` and the step counters are rank 0's; DGC's and
the vote's momentum are kept by survivors and zero on new ranks; ``Compression.auto``
decides its routes again on every new world (under ``horovodrun`` elastic the optimizer's
constructor does not decide: a rank that joins later runs no collective there).

After a failure (a rank killed, ``HorovodInternalError``) every survivor rolls back to the
last commit: model, optimizer and its own committed owed state (chunk residuals folded as
above). Gradients computed since the commit are recomputed by the survivors; the dead
rank's owed state at the commit is lost, unless ``pool_on_commit=True``: then each
``commit()`` also sums the owed state over the ranks (one all-reduce of the model's size per
commit) and a restore hands every rank ``1/W'`` of that committed sum, so nothing owed is
lost. PowerSGD's ``Q`` is kept because it does not depend on ``W``.
:class:`~hvd_compress.torch.OneBitAdam` (and 1-bit LAMB, 0/1 Adam) passed as the
optimizer gets :class:`OneBitStateHandler`: its compressed exchange's state follows the
same policy, its frozen variance travels with the Adam state as Horovod's handler would
carry it, and its step count is rank 0's after a sync.

Advice: commit every few steps (a commit deep-copies the model and the optimizer state).
See docs/elastic.md.
"""

from __future__ import annotations

import copy
from typing import Any

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.torch.elastic.state import StateHandler
from horovod.torch.elastic.state import TorchState as HorovodTorchState

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.elastic import (
    ElasticCompression,
    StandInPushes,
    check_elastic_wiring,
    fold_chunk_residuals,
    owed,
    pool_owed,
    share_owed,
)
from hvd_compress.pipeline import Pipeline
from hvd_compress.torch.onebit_adam import OneBitMomentum
from hvd_compress.torch.optimizer import _on_devices, broadcast_optimizer_state

__all__ = ["CompressionStateHandler", "OneBitStateHandler", "StandInPushes", "TorchState",
           "fold_chunk_residuals", "owed", "pool_owed", "share_owed"]


class CompressionStateHandler(ElasticCompression, StateHandler):
    """Horovod's state handler for a :func:`~hvd_compress.torch.DistributedOptimizer`
    (module docstring: what each kind of compression state does at a reset). Refuses
    (``ValueError`` saying what to use) an optimizer built with ``collectives="gloo"`` or
    ``"nccl"``, with ``ps="mpi"`` (:func:`hvd_compress.elastic.check_elastic_wiring`) or
    with ``hierarchy="host"``."""

    def __init__(self, optimizer: Any, pool_on_commit: bool = False,
                 ps_workers: int | None = None) -> None:
        if not hasattr(optimizer, "_rewire"):
            raise TypeError("CompressionStateHandler takes a "
                            "hvd_compress.torch.DistributedOptimizer")
        check_elastic_wiring(optimizer._wiring[1], optimizer._wiring[2])
        if not isinstance(optimizer._pipeline, Pipeline):
            raise ValueError("elastic training needs hierarchy=None: the two-level "
                             "pipeline's host groups are made for the first world. Build "
                             "the DistributedOptimizer without hierarchy= for elastic jobs")
        StateHandler.__init__(self, optimizer)
        ElasticCompression.__init__(self, pool_on_commit, ps_workers)
        self.save()

    # ElasticCompression's parts ------------------------------------------------------------
    @property
    def pipeline(self) -> Pipeline:
        return self.value._pipeline

    def shapes(self) -> dict[str, torch.Size]:
        return {name: p.shape for p, name in self.value._parameter_names.items()}

    def broadcast_object(self, obj: Any) -> Any:
        return hvd.broadcast_object(obj, root_rank=0)

    def communicator(self, session: str) -> Communicator:
        opt = self.value
        spec, timeout = opt._wiring[2], opt._wiring[3]
        comm = opt._rewire(session, self.ps_workers)
        comm = self.stand_ins(comm, spec, timeout)
        opt._use(comm)
        return comm

    def place(self, state: dict[str, Any]) -> dict[str, Any]:
        return _on_devices(state, {name: p.device
                                   for p, name in self.value._parameter_names.items()})

    def device(self) -> torch.device:
        first = next(iter(self.value._parameter_names), None)
        return first.device if first is not None else torch.device("cpu")

    def snapshot(self) -> None:
        """The state a failure before the next commit restores: the state after a reset
        (the committed one, rewired), whose chunk residuals are already folded."""
        self._saved = copy.deepcopy(self.value.state_dict())

    def broadcast_wrapped(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)

    # What StateHandler asks for ------------------------------------------------------------
    def restore(self) -> None:
        """Back to the last commit, with the chunk residuals folded in this rank's (old)
        chunking; with ``pool_on_commit`` the committed pooled sum is shared at the reset."""
        self.discard_step()
        self.value.load_state_dict(self._saved)
        self.after_restore()


class OneBitStateHandler(CompressionStateHandler):
    """Horovod's state handler for :class:`~hvd_compress.torch.OneBitAdam` (and the other
    optimizers of its family: 1-bit LAMB, 0/1 Adam), which exchange by themselves: the
    compressed exchange's state follows the same policy as a
    :func:`DistributedOptimizer`'s, both of its exchanges are rewired to Horovod's ranks
    at a reset, and the step count, which picks the stage, is rank 0's after a sync. The
    frozen variance is one of the wrapped Adam's state tensors: committed, restored and
    broadcast with the optimizer's state."""

    def __init__(self, optimizer: Any, pool_on_commit: bool = False,
                 ps_workers: int | None = None) -> None:
        StateHandler.__init__(self, optimizer)
        ElasticCompression.__init__(self, pool_on_commit, ps_workers)
        self.save()

    @property
    def pipeline(self) -> Pipeline:
        return self.value._compressed

    def shapes(self) -> dict[str, torch.Size]:
        return {name: p.shape for p, name in self.value._names.items()}

    def communicator(self, session: str) -> Communicator:
        comm = HorovodTorchCommunicator()
        warmup = self.value._warmup
        warmup.comm = warmup.routes.comm = comm
        return comm

    def place(self, state: dict[str, Any]) -> dict[str, Any]:
        return _on_devices(state, {name: p.device for p, name in self.value._names.items()})

    def device(self) -> torch.device:
        first = next(iter(self.value._names), None)
        return first.device if first is not None else torch.device("cpu")

    def broadcast_wrapped(self) -> None:
        """Rank 0's Adam state (the synchronised momentum, the frozen variance) and step
        count, as one object: Horovod's ``broadcast_optimizer_state`` would initialise a
        new rank's empty state with a ``step()``, which on this optimizer exchanges."""
        opt = self.value
        state = opt.state_dict()
        state.pop(opt.state_key, None)  # the compressed exchange's: sync() handles it
        state = hvd.broadcast_object({"adam": state, "global_step": opt.global_step},
                                     root_rank=0)
        opt.load_state_dict(state["adam"])
        opt.global_step = int(state["global_step"])

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)
        self.after_restore()


class TorchState(HorovodTorchState):
    """``hvd.elastic.TorchState`` whose :func:`DistributedOptimizer` values keep their
    compression state across resets (module docstring). ``pool_on_commit``: also pool
    what is owed at every commit, so that a killed rank's owed state is not lost (one
    all-reduce of the model's size per commit). ``ps_workers``: the parameter servers'
    ``--workers`` (``horovodrun --max-np``) when the optimizer has ``ps=``; while fewer
    ranks run, they stand in for the others (:class:`StandInPushes`). Other arguments as
    Horovod's. An optimizer built with ``collectives="gloo"``/``"nccl"`` or ``ps="mpi"`` is
    refused here with a ``ValueError`` saying what to use instead."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, *,
                 pool_on_commit: bool = False, ps_workers: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        for name, handler in list(self._handlers.items()):
            if hasattr(handler.value, "_rewire"):
                self._handlers[name] = CompressionStateHandler(handler.value, pool_on_commit,
                                                               ps_workers)
            elif isinstance(handler.value, OneBitMomentum):
                self._handlers[name] = OneBitStateHandler(handler.value, pool_on_commit)

    def _compression(self) -> list[CompressionStateHandler]:
        return [h for h in self._handlers.values() if isinstance(h, CompressionStateHandler)]

    def check_host_updates(self) -> None:
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt as interrupt:
            for handler in self._compression():
                handler.before_resize(interrupt.skip_sync)
            raise

    def on_reset(self) -> None:
        for handler in self._compression():
            handler.on_reset()
        super().on_reset()
