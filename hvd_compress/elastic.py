"""Elastic training, framework-neutral: what happens to a pipeline's compression state when
Horovod's elastic mode changes the world.

The bindings' state objects (:class:`hvd_compress.torch.elastic.TorchState`,
:class:`hvd_compress.tensorflow.elastic.KerasState`) keep the model and the wrapped
optimizer's state as Horovod's do, and hand the :class:`~hvd_compress.pipeline.Pipeline`'s
state to :class:`ElasticCompression`, which does the same thing for both:

    kind                                   survivors      new ranks    leaving ranks
    error-feedback residual, DGC velocity  pooled (owed)  pooled share handed over
    compressed all-reduce chunk residual   pooled (owed)  pooled share handed over
    PowerSGD P and Q, step counters        kept           rank 0's     -
    DGC / vote momentum (a rank's history) kept           zero         dropped
    Compression.auto's routes              decided again on the new world, by every rank

*Pooled*: at a resize announced by the discovery script (``HostsUpdatedInterrupt``, every
old rank still alive), every rank's owed state is summed over the old world (one
all-reduce of the model's size) and each rank of the new world of ``W'`` ranks holds
``1/W'`` of the sum (the chunk residual of the compressed all-reduce is first added into
the owning rank's residual at its chunk's place). Conserved, up to float rounding: ``sum of
applied aggregates + sum over ranks of owed = sum of all gradients``, in the units the ranks
submit. See docs/elastic.md.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from horovod.common.exceptions import HorovodInternalError

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import AllReduce, Collective, SparseSum
from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect
from hvd_compress.comm.ps_transport.base import PSError
from hvd_compress.pipeline import Pipeline
from hvd_compress.policy import AutoRoutes
from hvd_compress.schemes.dgc import VELOCITY
from hvd_compress.schemes.packed import CHUNK_RESIDUAL, chunk_sizes

LOCAL_KEYS = ("momentum",)
"""Scheme state that is a rank's own history (DGC's and the vote's momentum): kept by the
ranks that stay, zero on new ranks."""

POOL_ROUND = "hvd_compress.elastic.pool"

__all__ = ["ElasticCompression", "StandInPushes", "check_elastic_wiring",
           "fold_chunk_residuals", "owed", "pool_owed", "share_owed"]


def check_elastic_wiring(collectives: str, ps: str | None) -> None:
    """Refuse, with a ``ValueError`` saying what to use, what cannot follow an elastic
    reset: ``collectives="gloo"``/``"nccl"`` (a ``torch.distributed`` group is made once
    for the ranks of the first world, and a rank that joins later would make it alone) and
    ``ps="mpi"`` (the servers are ranks of one fixed-size ``mpirun``)."""
    if collectives != "horovod":
        raise ValueError(
            f"elastic training needs collectives='horovod', got collectives={collectives!r}: "
            "a torch.distributed group is made once, over the ranks of the first world, and "
            "cannot follow Horovod's resets. Build the DistributedOptimizer with "
            "collectives='horovod' (the default) for elastic jobs")
    if ps == "mpi":
        raise ValueError(
            "elastic training cannot use ps='mpi': MPI parameter servers are ranks of one "
            "mpirun, whose world cannot grow or shrink, and horovodrun's elastic mode "
            "starts no MPI world. Start the servers as processes (python -m ps_server "
            "--workers <horovodrun --max-np>) and pass ps='grpc://host:port,...' and "
            "ps_workers=<--max-np> to the elastic state")


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
            pooled[name] = total[offset:offset + part.numel()].view(shapes[name]).clone()
        offset += part.numel()
    return pooled


def zero_local(scheme_state: Mapping[str, Mapping[str, torch.Tensor]]
               ) -> dict[str, dict[str, torch.Tensor]]:
    """A new rank's scheme state from rank 0's: its own history and owed state at zero
    (the owed share comes from :func:`share_owed`), no chunk residual."""
    return {n: {k: torch.zeros_like(v) if k in LOCAL_KEYS or k == VELOCITY else v
                for k, v in st.items() if k != CHUNK_RESIDUAL}
            for n, st in scheme_state.items()}


def keep_local(common: Mapping[str, Mapping[str, torch.Tensor]],
               mine: Mapping[str, Mapping[str, torch.Tensor]]
               ) -> dict[str, dict[str, torch.Tensor]]:
    """Rank 0's scheme state ``common`` with a survivor's own history and owed state
    (``mine``) in place of rank 0's."""
    out = {n: dict(st) for n, st in common.items()}
    for name, st in out.items():
        for key in list(st):
            if key in LOCAL_KEYS or key in (VELOCITY, CHUNK_RESIDUAL):
                st[key] = mine.get(name, {}).get(key, torch.zeros_like(st[key]))
                if key == CHUNK_RESIDUAL and name not in mine:
                    del st[key]
    return out


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


def close_communicator(comm: Any) -> None:
    """Close a communicator's parameter-server clients, if it has any."""
    close = getattr(comm, "close", None) or getattr(getattr(comm, "client", None),
                                                    "close", None)
    if close is not None:
        close()


# The policy, on one pipeline ----------------------------------------------------------------
class ElasticCompression(ABC):
    """The compression state of one pipeline through Horovod's elastic resets (module
    docstring). A binding subclasses it and supplies the framework's parts: the pipeline,
    the tensors' shapes, Horovod's ``broadcast_object``, a communicator of the current
    ranks, where the tensors live, and the snapshot a failure goes back to; the binding's
    state object calls :meth:`save` at a commit, loads its snapshot and calls
    :meth:`after_restore` after a failure, calls :meth:`before_resize` when a resize is
    announced, :meth:`on_reset` after Horovod's reset and :meth:`sync` before the training
    function runs again (all on every rank of the world at hand, in that order).

    ``pool_on_commit``: also pool what is owed at every commit (one all-reduce of the
    model's size), so that a restore after a killed rank shares the committed sum.
    ``ps_workers``: the parameter servers' ``--workers`` (``horovodrun --max-np``) when the
    pipeline sends pairs to servers (:class:`StandInPushes`)."""

    def __init__(self, pool_on_commit: bool = False, ps_workers: int | None = None) -> None:
        self.pool_on_commit = pool_on_commit
        self.ps_workers = ps_workers
        self._session = os.urandom(4).hex()  # the job's; made common by the first sync
        self._epoch = 0  # resets so far: the parameter servers' session is per epoch
        self._fresh = True  # never synced: a new rank
        self._pending: dict[str, torch.Tensor] | None = None  # pooled sum to share
        self._share: dict[str, torch.Tensor] | None = None  # this reset's share
        self._committed_pool: dict[str, torch.Tensor] | None = None
        self._skip_sync = False  # the last resize only removed ranks
        self.decisions = 0  # Compression.auto's decisions made at resets

    # What the binding supplies ------------------------------------------------------------
    @property
    @abstractmethod
    def pipeline(self) -> Pipeline:
        """The pipeline whose state this object carries."""

    @abstractmethod
    def shapes(self) -> dict[str, torch.Size]:
        """Every exchanged tensor's shape, by its name in the pipeline."""

    @abstractmethod
    def broadcast_object(self, obj: Any) -> Any:
        """Horovod's ``broadcast_object`` from rank 0."""

    @abstractmethod
    def communicator(self, session: str) -> Communicator:
        """A new communicator of Horovod's current ranks (with parameter-server rounds
        under ``session`` when the pipeline sends pairs to servers, as one of
        :attr:`ps_workers` workers); the old one's clients closed."""

    def place(self, state: dict[str, Any]) -> dict[str, Any]:
        """A pipeline state received from rank 0, on this rank's devices."""
        return state

    def device(self) -> torch.device:
        """Where the gradients are (``Compression.auto`` measures there)."""
        return torch.device("cpu")

    @abstractmethod
    def snapshot(self) -> None:
        """Keep what a failure before the next commit restores."""

    def broadcast_wrapped(self) -> None:
        """Rank 0's state of what the binding wraps (the optimizer's own state), if the
        binding's state object does not broadcast it."""
        return None  # by default, nothing: the state object broadcasts it

    # The policy -----------------------------------------------------------------------------
    def save(self) -> None:
        """A commit: snapshot, and with ``pool_on_commit`` the owed state summed."""
        self.snapshot()
        self._share = None
        if self.pool_on_commit and not self._fresh:
            self._committed_pool = self.pool()

    def after_restore(self) -> None:
        """After the binding loaded the last commit: the chunk residuals folded in this
        rank's (old) chunking; with ``pool_on_commit`` the committed pooled sum is shared
        at the reset."""
        self.fold()
        if self._committed_pool is not None:
            self._pending = self._committed_pool

    def sync(self) -> None:
        """Every rank of the new world: rank 0's session, scheme state and wrapped state;
        new ranks take their share of what was pooled at this reset; ``Compression.auto``
        decides its routes for this world."""
        pipeline = self.pipeline
        mine = pipeline.state_dict()
        common = self.broadcast_object({
            "session": self._session, "epoch": self._epoch, "share": self._share,
            "state": {k: v for k, v in mine.items() if k != "residuals"}})
        self._session, self._epoch = common["session"], common["epoch"]
        self.rewire()
        self.broadcast_wrapped()
        if self._fresh:
            state = dict(common["state"], residuals={})
            state["scheme_state"] = zero_local(state["scheme_state"])
            state = share_owed(state, common["share"] or {})
        else:  # a survivor keeps its residuals and its own momentum
            state = dict(common["state"], residuals=mine["residuals"],
                         scheme_state=keep_local(common["state"]["scheme_state"],
                                                 mine["scheme_state"]))
        pipeline.load_state_dict(self.place(state))
        self._decide()
        self._fresh = False
        if self.pool_on_commit:
            self._committed_pool = self.pool()
        self.snapshot()

    def before_resize(self, skip_sync: bool = False) -> None:
        """A resize was announced and every old rank is alive: pool what is owed.
        ``skip_sync``: the interrupt's (ranks only leave, and Horovod will not call
        ``sync()``: :meth:`on_reset` decides ``Compression.auto``'s routes instead)."""
        self.fold()
        self._pending = self.pool()
        self._skip_sync = skip_sync

    def on_reset(self) -> None:
        """After Horovod's reset, before any collective: the new ranks' communicator and
        session, and this rank's share of a pooled sum."""
        self._epoch += 1
        self.rewire()
        if self._pending is not None:
            pooled = self._pending
            share = {n: v / self.pipeline.comm.size for n, v in pooled.items()}
            pipeline = self.pipeline
            pipeline.load_state_dict(share_owed(pipeline.state_dict(), share))
            self._share, self._pending = share, None
            if self.pool_on_commit:
                self._committed_pool = pooled
        if self._skip_sync:  # every rank of the new world is here, and no sync follows
            self._decide()
            self._skip_sync = False
        self.snapshot()

    # Helpers -------------------------------------------------------------------------------
    def rewire(self) -> Communicator:
        """The pipeline on Horovod's current ranks, with this epoch's server session."""
        pipeline = self.pipeline
        comm = self.communicator(f"{self._session}.{self._epoch}")
        pipeline.comm = pipeline.routes.comm = comm
        return comm

    def stand_ins(self, comm: Communicator, spec: str | None,
                  connect_timeout: float | None) -> Communicator:
        """``comm`` with :class:`StandInPushes` when the pipeline has servers and
        :attr:`ps_workers` is given (``ValueError`` if it is smaller than the world)."""
        if not spec or self.ps_workers is None:
            return comm
        if self.ps_workers < comm.size:
            raise ValueError(f"ps_workers={self.ps_workers} but Horovod has {comm.size} "
                             "ranks: start the servers with --workers equal to horovodrun's "
                             "--max-np and pass that")
        assert isinstance(comm, ParameterServerCommunicator)
        return StandInPushes(comm, spec, self.ps_workers, connect_timeout)

    def _decide(self) -> None:
        """``Compression.auto`` measures and decides its routes on the current world (every
        rank, at the same point); nothing for another scheme."""
        if not isinstance(self.pipeline.routes, AutoRoutes):
            return
        self.pipeline.routes.planned(self.shapes(), self.device())
        self.decisions += 1

    def fold(self) -> None:
        """This rank's chunk residuals added into its residual (no collective)."""
        pipeline = self.pipeline
        state = pipeline.state_dict()
        shapes = self.shapes()
        buckets = {}
        for name in state["scheme_state"]:
            codec = pipeline.route(name, shapes[name]).packed(torch.device("cpu"))
            buckets[name] = codec.bucket_size if codec is not None else 1
        pipeline.load_state_dict(fold_chunk_residuals(
            state, shapes, buckets, pipeline.comm.rank, pipeline.comm.size))

    def pool(self) -> dict[str, torch.Tensor]:
        """What the ranks owe, summed over them (an all-reduce: every rank calls it)."""
        pipeline = self.pipeline
        shapes = self.shapes()
        return pool_owed(owed(pipeline.state_dict()), sorted(shapes), shapes, pipeline.comm)

    def discard_step(self) -> None:
        """Forget a step whose exchanges a failure interrupted (nothing of it was
        committed)."""
        pipeline = self.pipeline
        if pipeline.pending:
            pipeline._failure = RuntimeError("discarded by an elastic restore")
            try:
                pipeline.wait()
            except RuntimeError:
                pass
