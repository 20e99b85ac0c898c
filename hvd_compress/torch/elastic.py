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

What happens to each kind of state when the world changes (the *owed* state is gradient
that a rank has computed but the model has not received yet)::

    kind                                   survivors      new ranks    leaving ranks
    error-feedback residual, DGC velocity  pooled (owed)  pooled share handed over
    compressed all-reduce chunk residual   pooled (owed)  pooled share handed over
    PowerSGD P and Q, step counters        kept           rank 0's     -
    DGC / vote momentum (a rank's history) kept           zero         dropped

*Pooled*: at a resize announced by the discovery script (``HostsUpdatedInterrupt``, every
old rank still alive), every rank's owed state is summed over the old world (one
all-reduce of the model's size) and each rank of the new world of ``W'`` ranks holds
``1/W'`` of the sum. The chunk residual of the compressed all-reduce (1-bit, QSGD, TernGrad
with error feedback) belongs to the chunking of ``W`` ranks, so it is first added into the
owning rank's residual at its chunk's place. What is conserved, exactly up to float
rounding: ``sum of applied aggregates + sum over ranks of owed = sum of all gradients``,
in the units the ranks submit (the optimizer then averages by the current ``W``).

After a failure (a rank killed, ``HorovodInternalError``) every survivor rolls back to the
last commit: model, optimizer and its own committed owed state (chunk residuals folded as
above). Gradients computed since the commit are recomputed by the survivors; the dead
rank's owed state at the commit is lost, unless ``pool_on_commit=True``: then each
``commit()`` also sums the owed state over the ranks (one all-reduce of the model's size per
commit) and a restore hands every rank ``1/W'`` of that committed sum, so nothing owed is
lost. PowerSGD's ``Q`` is kept because it does not depend on ``W``; 1-bit Adam's frozen
variance lives in :class:`~hvd_compress.torch.OneBitAdam`'s own state (pass that optimizer
to Horovod's state; this class handles :func:`DistributedOptimizer`).

Advice: commit every few steps (a commit deep-copies the model and the optimizer state).
See docs/elastic.md.
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.torch.elastic.state import StateHandler
from horovod.torch.elastic.state import TorchState as HorovodTorchState

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import AllReduce, Collective, SparseSum
from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect
from hvd_compress.comm.ps_transport.base import PSError
from hvd_compress.schemes.dgc import VELOCITY
from hvd_compress.schemes.packed import CHUNK_RESIDUAL, chunk_sizes
from hvd_compress.torch.optimizer import _on_devices, broadcast_optimizer_state

LOCAL_KEYS = ("momentum",)
"""Scheme state that is a rank's own history (DGC's and the vote's momentum): kept by the
ranks that stay, zero on new ranks."""

POOL_ROUND = "hvd_compress.elastic.pool"

__all__ = ["CompressionStateHandler", "StandInPushes", "TorchState", "fold_chunk_residuals",
           "owed", "pool_owed", "share_owed"]


# Pure functions on a pipeline's state_dict() ---------------------------------------------
def fold_chunk_residuals(state: Mapping[str, Any], shapes: Mapping[str, torch.Size],
                         bucket_sizes: Mapping[str, int], rank: int, size: int
                         ) -> dict[str, Any]:
    """``state`` (a ``Pipeline.state_dict()``) with each tensor's chunk residual, which
    this rank held for its chunk of a ``size``-rank compressed all-reduce, added into this
    rank's error-feedback residual at that chunk's place (``bucket_sizes``: the codec's
    bucket size per tensor). The sum of what the ranks owe is unchanged; the result no
    longer depends on ``size``."""
    state = dict(state)
    residuals = dict(state["residuals"])
    scheme_state = {n: dict(st) for n, st in state["scheme_state"].items()}
    for name, st in scheme_state.items():
        chunk = st.pop(CHUNK_RESIDUAL, None)
        if chunk is None:
            continue
        numel = shapes[name].numel()
        sizes = chunk_sizes(numel, size, bucket_sizes[name])
        if chunk.numel() != sizes[rank]:
            raise ValueError(f"{name}: chunk residual of {chunk.numel()} elements, but rank "
                             f"{rank} of {size} owns {sizes[rank]}")
        start = sum(sizes[:rank])
        flat = residuals.get(name)
        flat = (torch.zeros(numel, dtype=chunk.dtype, device=chunk.device) if flat is None
                else flat.detach().reshape(-1).clone())
        flat[start:start + sizes[rank]] += chunk.to(flat.dtype)
        residuals[name] = flat.view(shapes[name])
    state["residuals"] = residuals
    state["scheme_state"] = scheme_state
    return state


def owed(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """What a rank owes per tensor (after :func:`fold_chunk_residuals`): its error-feedback
    residual plus DGC's velocity."""
    out = {name: r.detach().clone() for name, r in state["residuals"].items()}
    for name, st in state["scheme_state"].items():
        velocity = st.get(VELOCITY)
        if velocity is not None:
            out[name] = (out[name] + velocity.view_as(out[name]) if name in out
                         else velocity.detach().clone())
    return out


def share_owed(state: Mapping[str, Any], share: Mapping[str, torch.Tensor]
               ) -> dict[str, Any]:
    """``state`` with what it owes replaced by ``share``: into DGC's velocity for a tensor
    that has one, else into the error-feedback residual."""
    state = dict(state)
    residuals = {n: r for n, r in state["residuals"].items() if n not in share}
    scheme_state = {n: dict(st) for n, st in state["scheme_state"].items()}
    for name, value in share.items():
        st = scheme_state.get(name, {})
        if VELOCITY in st:
            st[VELOCITY] = value.reshape(st[VELOCITY].shape).to(st[VELOCITY].dtype)
        else:
            residuals[name] = value.clone()
    state["residuals"] = residuals
    state["scheme_state"] = scheme_state
    return state


def pool_owed(amounts: Mapping[str, torch.Tensor], names: list[str],
              shapes: Mapping[str, torch.Size], comm: Communicator
              ) -> dict[str, torch.Tensor]:
    """The sum over ``comm``'s ranks of ``amounts`` (one all-reduce of the concatenation
    of ``names``, zeros where a rank owes nothing); every rank must pass the same
    ``names``. Tensors that no rank owed anything for are left out."""
    if not names:
        return {}
    some = next(iter(amounts.values()), None)
    device = some.device if some is not None else torch.device("cpu")
    parts = [amounts[n].reshape(-1).float() if n in amounts
             else torch.zeros(shapes[n].numel(), device=device) for n in names]
    held = torch.tensor([1.0 if n in amounts else 0.0 for n in names], device=device)
    total = comm.wait(comm.start(POOL_ROUND, AllReduce(POOL_ROUND,
                                                       torch.cat([*parts, held]))))
    assert isinstance(total, torch.Tensor)
    flags = total[-len(names):]
    pooled, offset = {}, 0
    for name, part, flag in zip(names, parts, flags):
        if flag > 0:
            pooled[name] = total[offset:offset + part.numel()].view(shapes[name])
        offset += part.numel()
    return pooled


# Parameter servers whose --workers is the job's largest size --------------------------------
class StandInPushes:
    """A :class:`~hvd_compress.comm.parameter_server.ParameterServerCommunicator` for a
    world of ``W`` ranks smaller than the servers' ``--workers N`` (start the servers with
    ``--workers`` equal to ``horovodrun --max-np``): rank ``r`` also pushes an empty set
    of pairs for each absent worker id ``g`` in ``W..N-1`` with ``g % W == r``, each
    through a client of its own (the servers bind each id of a session to one client), so
    every round closes with the ``W`` real pushes and nothing waits for a worker that is
    not there. The aggregate is the ``W`` ranks' sum. A round the servers fail (a worker
    died and its push never came, ``--deadline``) raises ``HorovodInternalError``, so
    ``hvd.elastic.run`` restores the last commit and resets instead of stopping."""

    def __init__(self, inner: ParameterServerCommunicator, spec: str, workers: int,
                 connect_timeout: float | None = None) -> None:
        self.inner = inner
        self.dense = inner.dense
        self.rank, self.size = inner.rank, inner.size
        self.ordered = inner.ordered
        self.stand_ins = [connect(spec, g, workers=workers, connect_timeout=connect_timeout)
                          for g in range(self.size, workers) if g % self.size == self.rank]
        self._rounds: dict[str, int] = defaultdict(int)

    def start(self, name: str, op: Collective) -> Any:
        if not isinstance(op, SparseSum):
            return self.inner.start(name, op)
        round = self._rounds[name]  # the inner communicator counts the same way
        self._rounds[name] += 1
        handle = self.inner.start(name, op)
        indices, values = (t.detach()[:0].cpu() for t in (op.indices, op.values))
        empty = [c.start(f"{self.inner.session}/{name}", round, op.numel, indices, values)
                 for c in self.stand_ins]
        return _StandInRound(handle, empty)

    def wait(self, handle: Any) -> Any:
        if not isinstance(handle, _StandInRound):
            return self.inner.wait(handle)
        try:
            result = self.inner.wait(handle.real)
            for client, pending in zip(self.stand_ins, handle.empty):
                client.finish(pending)
        except PSError as err:
            raise HorovodInternalError(f"parameter-server round failed, taken as a lost "
                                       f"worker: {err}") from err
        return result

    def close(self) -> None:
        for client in [self.inner.client, *self.stand_ins]:
            client.close()


class _StandInRound:
    def __init__(self, real: Any, empty: list[Any]) -> None:
        self.real, self.empty = real, empty


# The Horovod state handler ----------------------------------------------------------------
class CompressionStateHandler(StateHandler):
    """Horovod's state handler for a :func:`~hvd_compress.torch.DistributedOptimizer`
    (module docstring: what each kind of compression state does at a reset)."""

    def __init__(self, optimizer: Any, pool_on_commit: bool = False,
                 ps_workers: int | None = None) -> None:
        if not hasattr(optimizer, "_rewire"):
            raise TypeError("CompressionStateHandler takes a "
                            "hvd_compress.torch.DistributedOptimizer")
        if optimizer._wiring[1] != "horovod":
            raise ValueError("elastic training needs collectives='horovod' (a "
                             "torch.distributed group cannot follow Horovod's resets)")
        super().__init__(optimizer)
        self.pool_on_commit = pool_on_commit
        self.ps_workers = ps_workers
        self._session = os.urandom(4).hex()  # the job's; made common by the first sync
        self._epoch = 0  # resets so far: the parameter servers' session is per epoch
        self._fresh = True  # never synced: a new rank
        self._pending: dict[str, torch.Tensor] | None = None  # pooled sum to share
        self._share: dict[str, torch.Tensor] | None = None  # this reset's share
        self._committed_pool: dict[str, torch.Tensor] | None = None
        self.save()

    # What StateHandler asks for ------------------------------------------------------------
    def save(self) -> None:
        self._snapshot()
        self._share = None
        if self.pool_on_commit and not self._fresh:
            self._committed_pool = self._pool()

    def restore(self) -> None:
        """Back to the last commit, with the chunk residuals folded in this rank's (old)
        chunking; with ``pool_on_commit`` the committed pooled sum is shared at the reset."""
        _discard_step(self.value)
        self.value.load_state_dict(self._saved)
        self._fold()
        if self._committed_pool is not None:
            self._pending = self._committed_pool

    def sync(self) -> None:
        """Every rank of the new world: rank 0's session, scheme state and optimizer state;
        new ranks take their share of what was pooled at this reset."""
        opt = self.value
        pipeline = opt._pipeline
        mine = pipeline.state_dict()
        common = hvd.broadcast_object({
            "session": self._session, "epoch": self._epoch, "share": self._share,
            "state": {k: v for k, v in mine.items() if k != "residuals"}}, root_rank=0)
        self._session, self._epoch = common["session"], common["epoch"]
        self._rewire()
        broadcast_optimizer_state(opt, root_rank=0)
        if self._fresh:
            state = dict(common["state"], residuals={})
            state["scheme_state"] = _zero_local(state["scheme_state"])
            state = share_owed(state, common["share"] or {})
        else:  # a survivor keeps its residuals and its own momentum
            state = dict(common["state"], residuals=mine["residuals"],
                         scheme_state=_keep_local(common["state"]["scheme_state"],
                                                  mine["scheme_state"]))
        pipeline.load_state_dict(_on_devices(state, _devices(opt)))
        self._fresh = False
        if self.pool_on_commit:
            self._committed_pool = self._pool()
        self._snapshot()

    # Resets --------------------------------------------------------------------------------
    def before_resize(self) -> None:
        """A resize was announced and every old rank is alive: pool what is owed."""
        self._fold()
        self._pending = self._pool()

    def on_reset(self) -> None:
        """After Horovod's reset, before any collective: the new ranks' communicator and
        session, and this rank's share of a pooled sum."""
        self._epoch += 1
        self._rewire()
        if self._pending is not None:
            pooled = self._pending
            share = {n: v / hvd.size() for n, v in pooled.items()}
            pipeline = self.value._pipeline
            pipeline.load_state_dict(share_owed(pipeline.state_dict(), share))
            self._share, self._pending = share, None
            if self.pool_on_commit:
                self._committed_pool = pooled
        self._snapshot()

    # Helpers -------------------------------------------------------------------------------
    def _snapshot(self) -> None:
        """The state a failure before the next commit restores: the state after a reset
        (the committed one, rewired), whose chunk residuals are already folded."""
        self._saved = copy.deepcopy(self.value.state_dict())

    def _rewire(self) -> None:
        """The optimizer on Horovod's current ranks, with this epoch's server session."""
        opt = self.value
        spec, timeout = opt._wiring[2], opt._wiring[3]
        comm = opt._rewire(f"{self._session}.{self._epoch}", self.ps_workers)
        if spec and self.ps_workers is not None:
            if self.ps_workers < comm.size:
                raise ValueError(f"ps_workers={self.ps_workers} but Horovod has "
                                 f"{comm.size} ranks: start the servers with --workers "
                                 "equal to horovodrun's --max-np and pass that")
            opt._use(StandInPushes(comm, spec, self.ps_workers, timeout))

    def _shapes(self) -> dict[str, torch.Size]:
        return {name: p.shape for p, name in self.value._parameter_names.items()}

    def _fold(self) -> None:
        pipeline = self.value._pipeline
        state = pipeline.state_dict()
        shapes = self._shapes()
        buckets = {}
        for name in state["scheme_state"]:
            codec = pipeline.route(name, shapes[name]).packed(torch.device("cpu"))
            buckets[name] = codec.bucket_size if codec is not None else 1
        pipeline.load_state_dict(fold_chunk_residuals(
            state, shapes, buckets, pipeline.comm.rank, pipeline.comm.size))

    def _pool(self) -> dict[str, torch.Tensor]:
        pipeline = self.value._pipeline
        shapes = self._shapes()
        return pool_owed(owed(pipeline.state_dict()), sorted(shapes), shapes, pipeline.comm)


def _discard_step(optimizer: Any) -> None:
    """Forget a step whose exchanges a failure interrupted (nothing of it was committed)."""
    pipeline = optimizer._pipeline
    if pipeline.pending:
        pipeline._failure = RuntimeError("discarded by an elastic restore")
        try:
            pipeline.wait()
        except RuntimeError:
            pass


def _zero_local(scheme_state: Mapping[str, Mapping[str, torch.Tensor]]
                ) -> dict[str, dict[str, torch.Tensor]]:
    """A new rank's scheme state from rank 0's: its own history and owed state at zero
    (the owed share comes from :func:`share_owed`), no chunk residual."""
    return {n: {k: torch.zeros_like(v) if k in LOCAL_KEYS or k == VELOCITY else v
                for k, v in st.items() if k != CHUNK_RESIDUAL}
            for n, st in scheme_state.items()}


def _keep_local(common: Mapping[str, Mapping[str, torch.Tensor]],
                mine: Mapping[str, Mapping[str, torch.Tensor]]
                ) -> dict[str, dict[str, torch.Tensor]]:
    out = {n: dict(st) for n, st in common.items()}
    for name, st in out.items():
        for key in list(st):
            if key in LOCAL_KEYS or key in (VELOCITY, CHUNK_RESIDUAL):
                st[key] = mine.get(name, {}).get(key, torch.zeros_like(st[key]))
                if key == CHUNK_RESIDUAL and name not in mine:
                    del st[key]
    return out


def _devices(optimizer: Any) -> dict[str, torch.device]:
    return {name: p.device for p, name in optimizer._parameter_names.items()}


class TorchState(HorovodTorchState):
    """``hvd.elastic.TorchState`` whose :func:`DistributedOptimizer` values keep their
    compression state across resets (module docstring). ``pool_on_commit``: also pool
    what is owed at every commit, so that a killed rank's owed state is not lost (one
    all-reduce of the model's size per commit). ``ps_workers``: the parameter servers'
    ``--workers`` (``horovodrun --max-np``) when the optimizer has ``ps=``; while fewer
    ranks run, they stand in for the others (:class:`StandInPushes`). Other arguments as
    Horovod's."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, *,
                 pool_on_commit: bool = False, ps_workers: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        for name, handler in list(self._handlers.items()):
            if hasattr(handler.value, "_rewire"):
                self._handlers[name] = CompressionStateHandler(handler.value, pool_on_commit,
                                                               ps_workers)

    def _compression(self) -> list[CompressionStateHandler]:
        return [h for h in self._handlers.values() if isinstance(h, CompressionStateHandler)]

    def check_host_updates(self) -> None:
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt:
            for handler in self._compression():
                handler.before_resize()
            raise

    def on_reset(self) -> None:
        for handler in self._compression():
            handler.on_reset()
        super().on_reset()
