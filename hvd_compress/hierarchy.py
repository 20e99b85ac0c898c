"""Two-level compression (``hierarchy="host"``): dense inside a host, compressed across hosts.

Per step and tensor, on a job of ``H`` hosts with ``L`` ranks each::

    gradient -> dense sum of this local rank's piece over the host's L ranks (a
                reduce-scatter inside the host: an all-to-all of the pieces, summed in
                local rank order)
             -> the scheme's exchange of that piece across the H hosts, among the ranks of
                this local rank (a Pipeline of its own)
             -> all-gather of every local rank's aggregated pieces inside the host
             -> average over H * L -> gradient for the optimizer

Which piece each local rank carries (:func:`split_of`):

* ``"slices"`` (schemes marked ``sliceable``, which compress entries or row blocks
  independently: none, fp16,
  bf16, 1-bit, QSGD, TernGrad, the majority vote, top-k, random-k, threshold, DGC): every
  tensor of at least ``L`` rows is cut into ``L`` row blocks, local rank ``l`` carrying
  block ``l``, so all ``L`` links and codecs of a host work at once, as in Horovod's
  hierarchical all-reduce. Tensors with fewer rows go whole, to one local rank.
* ``"tensors"`` (any scheme not known to be sliceable; PowerSGD too in a
  :class:`HierarchicalPipeline` built directly): every tensor goes whole to one local rank,
  tensors assigned largest first to the least loaded local rank (a leader per tensor; a
  job with one big matrix has one busy link).

A scheme whose every round is an all-reduce of something linear in the gradient
(:attr:`~hvd_compress.schemes.base.Scheme.linear_rounds`: PowerSGD, whose ``P = sum_i M_i
Q``) skips the dense sum: :class:`RoundsPipeline` runs the flat algorithm, each round's
all-reduce done in two levels (in-host reduce-scatter of the factors, cross-host all-reduce
of this local rank's slice, in-host all-gather:
:class:`~hvd_compress.comm.two_level.HostTwoLevelCommunicator`), so only the factors cross
the host's loopback and every host link carries ``1/L`` of them (split ``"rounds"``;
:func:`two_level_pipeline` chooses).

The scheme, its error feedback and its state live with the local rank that compresses the
piece (its residual is that of the host sum's piece); the routes (compress or send dense)
are those the policy gives the whole tensor. The dense sum inside the host is exact for
integer-valued gradients, so ``Compression.none`` gives the flat route's aggregate bit for
bit then. Which ranks share a host: Horovod's (``hvd.cross_rank()``, ``hvd.local_rank()``),
split by network namespace (emulated hosts on one machine), or
``$HVD_COMPRESS_RANKS_PER_HOST`` consecutive ranks (to emulate hosts without namespaces).
Inside a host the ranks meet in shared memory where they can
(:class:`~hvd_compress.comm.shm.ShmHostCommunicator`, :func:`host_shm`), else over
Horovod's process set of the host.
Both bindings run this module's pipeline (:func:`horovod_pipeline`), each over its own
Horovod communicator: the PyTorch optimizer, and the TensorFlow tape and Keras optimizer
(their gradients reach it through DLPack). See docs/user-guide.md#two-level-compression.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.comm.two_level import (
    HOST_ROUND,
    HostTwoLevelCommunicator,
    sum_in_order,
    wait_sum,
)
from hvd_compress.errors import NonFiniteGradientError
from hvd_compress.fusion import assign_buckets
from hvd_compress.native import buffers
from hvd_compress.pipeline import DEFAULT_BUCKET_BYTES, DEFAULT_REPORT_EVERY, Pipeline
from hvd_compress.policy import Auto, Policy, Routes
from hvd_compress.schemes.base import Scheme, write_scaled
from hvd_compress.step_stats import StepStats

HIERARCHIES = (None, "host")
"""The values of the optimizers' ``hierarchy=``: ``None`` (flat), ``"host"``."""

RANKS_PER_HOST_ENV = "HVD_COMPRESS_RANKS_PER_HOST"
"""Set to ``k``: ranks ``0..k-1`` form host 0, ``k..2k-1`` host 1, and so on, instead of
Horovod's hosts (for emulated clusters and tests on one machine)."""


def split_of(scheme: Scheme) -> str:
    """``"slices"`` for a :attr:`~hvd_compress.schemes.base.Scheme.sliceable` scheme, else
    ``"tensors"`` (whole tensors)."""
    return "slices" if scheme.sliceable else "tensors"


# Which ranks share a host ---------------------------------------------------------------
@dataclass(frozen=True)
class HostLayout:
    """The job's hosts, each the tuple of its global ranks in rank order, and this rank."""

    hosts: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def from_keys(cls, keys: Sequence[Any], rank: int) -> HostLayout:
        """The layout from every rank's host key (rank order); hosts numbered by their first
        rank. ``ValueError`` if hosts hold different numbers of ranks."""
        hosts: dict[Any, list[int]] = {}
        for r, key in enumerate(keys):
            hosts.setdefault(key, []).append(r)
        sizes = sorted({len(ranks) for ranks in hosts.values()})
        if len(sizes) != 1:
            raise ValueError(f"hierarchy='host' needs the same number of ranks on every host; "
                             f"got hosts of {sizes} ranks ({dict(hosts)})")
        return cls(tuple(tuple(ranks) for ranks in hosts.values()), rank)

    @property
    def host(self) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        return self.hosts[self.host].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.hosts[0])

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's host."""
        return self.hosts[self.host]

    @property
    def cross_ranks(self) -> tuple[int, ...]:
        """The global ranks of this local rank on every host, in host order."""
        return tuple(ranks[self.local_rank] for ranks in self.hosts)


def host_key(rank: int, horovod_key: Any) -> Any:
    """This rank's host: ``rank // $HVD_COMPRESS_RANKS_PER_HOST`` when that is set, else
    ``horovod_key``."""
    per_host = os.environ.get(RANKS_PER_HOST_ENV)
    if not per_host:
        return horovod_key
    try:
        k = int(per_host)
        if k < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"${RANKS_PER_HOST_ENV} must be a whole number of ranks >= 1, got "
                         f"{per_host!r}") from None
    return rank // k


def network_namespace() -> int | None:
    """This process's network namespace (the inode of ``/proc/self/ns/net``), or ``None``
    where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None


def solo() -> Communicator:
    """A communicator of one rank (collectives return this rank's own input)."""
    return ThreadGroup(1).communicator(0)


def horovod_host_communicators(
        hvd: Any, communicator: Callable[[Any], Communicator] | None = None
) -> tuple[HostLayout, Communicator, Communicator]:
    """The layout and the (inside the host, across hosts) communicators of Horovod's global
    ranks, over process sets: those registered at ``hvd.init(process_sets=...)`` with these
    ranks, else added now (``hvd.add_process_set``, which needs
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``). ``hvd``: ``horovod.torch`` or
    ``horovod.tensorflow``; ``communicator``: the binding's communicator over one process
    set (default :class:`~hvd_compress.comm.horovod_torch.HorovodTorchCommunicator`; the
    TensorFlow binding passes its ``HorovodTFCommunicator``). Collective: every rank calls
    it at the same point (eagerly, outside any traced graph)."""
    from horovod.common import process_sets as sets

    if communicator is None:
        from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
        communicator = HorovodTorchCommunicator

    # Horovod's host, split by network namespace: ranks of one machine in different
    # namespaces (an emulated cluster, where MPI sees one node) are different hosts.
    keys = hvd.allgather_object(host_key(hvd.rank(), (hvd.cross_rank(), network_namespace())))
    layout = HostLayout.from_keys(keys, hvd.rank())
    registered = {tuple(ranks): pid for pid, ranks in
                  sets._basics._get_process_set_ids_and_ranks().items()}
    mine: dict[tuple[int, ...], Any] = {}
    groups = [*layout.hosts, *zip(*layout.hosts, strict=True)]
    for ranks in groups:  # every rank adds every set, in the same order
        ranks = tuple(ranks)
        if len(ranks) == 1 or ranks in mine:
            continue
        if ranks in registered:
            mine[ranks] = sets._temp_process_set_object(registered[ranks])
            continue
        try:
            mine[ranks] = hvd.add_process_set(list(ranks))
        except ValueError as exc:
            raise ValueError(
                f"hierarchy='host' needs a Horovod process set per host and per local rank "
                f"({[list(g) for g in groups]}): start Horovod with "
                f"HOROVOD_DYNAMIC_PROCESS_SETS=1, or register them at hvd.init(process_sets="
                f"[hvd.ProcessSet(ranks), ...]) ({exc})") from exc

    def of(ranks: tuple[int, ...]) -> Communicator:
        return solo() if len(ranks) == 1 else communicator(mine[ranks])

    local = host_shm(hvd, layout) or of(layout.local_ranks)
    return layout, local, of(layout.cross_ranks)


def host_shm(hvd: Any, layout: HostLayout) -> Communicator | None:
    """The host's shared-memory communicator (:mod:`hvd_compress.comm.shm`) where
    ``$HVD_COMPRESS_HOST_SHM`` allows it and the host's ranks share ``/dev/shm``, else
    ``None`` (Horovod's process set then). Collective: every rank of the job calls it (a
    host of one rank, or ``$HVD_COMPRESS_HOST_SHM=0`` on every rank, calls nothing)."""
    from hvd_compress.comm import shm

    mode = shm.mode()
    if mode == "off" or layout.local_size == 1:
        return None
    if not shm.supported():
        if mode == "on":
            raise RuntimeError(f"${shm.SHM_ENV}=1, but the shared-memory route needs an "
                               "x86-64 host; unset it for Horovod's route")
        return None
    return shm.open_host(layout.local_rank, layout.local_size, layout.host,
                         hvd.allgather_object, required=mode == "on")


def check_hierarchy(hierarchy: str | None, scheme: Any, *, collectives: str = "horovod",
                    ps: str | None = None, process_set: Any = None,
                    global_set: Any = None) -> None:
    """``ValueError``, saying what to change, for a ``hierarchy=`` the optimizer cannot
    run: an unknown value, ``Compression.auto``, ``collectives`` other than Horovod's, a
    process set other than the global one, ``ps="mpi"`` or Horovod's elastic mode."""
    if hierarchy not in HIERARCHIES:
        raise ValueError(f"hierarchy must be one of {HIERARCHIES}, got {hierarchy!r}")
    if hierarchy is None:
        return
    where = "hierarchy='host' (docs/user-guide.md#two-level-compression)"
    if isinstance(scheme, Auto):
        raise ValueError(f"{where} does not support Compression.auto yet; pick a scheme")
    if collectives != "horovod":
        raise ValueError(f"{where} runs over Horovod's process sets; pass "
                         f"collectives='horovod', not {collectives!r}")
    if process_set is not None and global_set is not None \
            and process_set.process_set_id != global_set.process_set_id:
        raise ValueError(f"{where} splits Horovod's global ranks into hosts; pass "
                         "process_set=None")
    if ps == "mpi":
        raise ValueError(f"{where} sends sparse pairs to gRPC servers only; use "
                         "ps='grpc://...' or no ps")
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise ValueError(f"{where} is not supported under horovodrun's elastic mode")


def horovod_pipeline(hvd: Any, scheme: Scheme, policy: Policy | None, ps: str | None,
                     session: str | None, connect_timeout: float | None,
                     communicator: Callable[[Any], Communicator] | None = None,
                     **options: Any) -> HierarchicalPipeline | RoundsPipeline:
    """The two-level pipeline of Horovod's global ranks (:func:`horovod_host_communicators`,
    with the binding's ``hvd`` and ``communicator``): :func:`two_level_pipeline`'s choice.
    With ``ps``, the sparse pairs of local rank ``l``'s pieces go to the servers as worker
    ``host`` of a job of ``H`` workers, in session ``<session>.l<l>`` (one push per host and
    piece); a scheme with ``linear_rounds`` sends none, and connects to no server.
    ``options``: :class:`HierarchicalPipeline`'s."""
    from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect

    layout, local, cross = horovod_host_communicators(hvd, communicator)
    if scheme.linear_rounds:  # all-reduces only: no sparse pairs for a server
        return RoundsPipeline(scheme, local, cross, policy, **options)
    if ps:
        cross = ParameterServerCommunicator(
            cross, connect(ps, cross.rank, workers=cross.size, connect_timeout=connect_timeout),
            f"{session}.l{layout.local_rank}")
    return HierarchicalPipeline(scheme, local, cross, policy, **options)


def two_level_pipeline(scheme: Scheme, local: Communicator, cross: Communicator,
                       policy: Policy | None = None, **options: Any
                       ) -> HierarchicalPipeline | RoundsPipeline:
    """The two-level pipeline of a scheme: :class:`RoundsPipeline` when its
    :attr:`~hvd_compress.schemes.base.Scheme.linear_rounds` (PowerSGD), else
    :class:`HierarchicalPipeline` (a dense sum inside the host, the scheme across hosts).
    ``options``: theirs (``split`` for :class:`HierarchicalPipeline` only)."""
    if scheme.linear_rounds and "split" not in options:
        return RoundsPipeline(scheme, local, cross, policy, **options)
    return HierarchicalPipeline(scheme, local, cross, policy, **options)


class RoundsPipeline(Pipeline):
    """The flat :class:`~hvd_compress.pipeline.Pipeline` of a scheme whose every round is an
    all-reduce of something linear in the gradient (``linear_rounds``: PowerSGD), over
    :class:`~hvd_compress.comm.two_level.HostTwoLevelCommunicator`: each round is summed
    inside the host (a reduce-scatter of the factors), across hosts (this local rank's
    slice) and all-gathered inside the host. The same algorithm as the flat route (the
    sums in another order), error feedback and scheme state per rank as there; only the
    factors, never the dense gradients, cross the host's loopback.

    Args:
        scheme: the scheme (``linear_rounds``).
        local, cross: as :class:`HierarchicalPipeline`'s.
        policy, options: :class:`~hvd_compress.pipeline.Pipeline`'s (``average`` divides by
            ``local.size * cross.size``).

    ``last_step.collective_bytes["host"]`` counts the bytes handed to in-host collectives;
    each round's own count (``"P"``, ``"Q"``, ``"dense"``) is the whole tensor, as flat.
    """

    comm: HostTwoLevelCommunicator

    def __init__(self, scheme: Scheme, local: Communicator, cross: Communicator,
                 policy: Policy | None = None, **options: Any) -> None:
        check_hierarchy("host", scheme)
        if not scheme.linear_rounds:
            raise ValueError(f"{scheme.describe()} has rounds other than linear all-reduces; "
                             "use HierarchicalPipeline (two_level_pipeline chooses)")
        super().__init__(scheme, HostTwoLevelCommunicator(local, cross), policy, **options)
        self.local, self.cross = local, cross
        self.split = "rounds"

    def wait(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """As :meth:`Pipeline.wait`, adding the step's in-host bytes to its statistics."""
        try:
            out = super().wait(into)
        finally:
            host = self.comm.take_host_bytes()
        self.last_step.collective_bytes[HOST_ROUND] += host
        self.total.collective_bytes[HOST_ROUND] += host
        return out

    def layout(self) -> dict[str, Any]:
        return layout_of(self.local, self.cross, self.split)

    def state_dict(self) -> dict[str, Any]:
        """The flat pipeline's state (this rank's residuals and scheme state) and the
        layout it holds for."""
        return {**super().state_dict(), "hierarchy": self.layout()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(check_layout(state, self.layout()))


def layout_of(local: Communicator, cross: Communicator, split: str) -> dict[str, Any]:
    """What a two-level state holds for: hosts, ranks per host, local rank, split."""
    return {"hosts": cross.size, "ranks_per_host": local.size, "local_rank": local.rank,
            "split": split}


def check_layout(state: Mapping[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """``state`` without its ``"hierarchy"`` entry; ``ValueError`` if that is not
    ``layout`` (a two-level state resumes on the same layout only)."""
    state = dict(state)
    saved = state.pop("hierarchy", None)
    if saved != layout:
        raise ValueError(f"compression state was saved with hierarchy {saved} but this "
                         f"rank runs {layout}; resume each rank from its own "
                         "state on the same hosts x ranks-per-host layout")
    return state


# The pieces ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """The part ``[start, stop)`` of tensor ``tensor`` (flat), of shape ``shape``, carried
    across hosts by local rank ``owner`` under the name ``key``."""

    tensor: str
    key: str
    owner: int
    start: int
    stop: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.stop - self.start


def cut(names: Sequence[str], shapes: Sequence[torch.Size], local_size: int, split: str,
        loads: list[int] | None = None) -> dict[str, list[Piece]]:
    """Each tensor's pieces: ``local_size`` row blocks (``split="slices"`` and at least
    ``local_size`` rows), else the whole tensor for the least loaded local rank (largest
    tensors first, ties by order given). ``loads`` (elements per local rank) is updated."""
    loads = loads if loads is not None else [0] * local_size
    pieces: dict[str, list[Piece]] = {}
    whole = []
    for name, shape in zip(names, shapes, strict=True):
        n = shape.numel()
        if split == "slices" and len(shape) >= 1 and shape[0] >= local_size > 1:
            row = n // shape[0]
            cuts = [shape[0] * i // local_size for i in range(local_size + 1)]
            pieces[name] = [Piece(name, f"{name}#{i}", i, a * row, b * row,
                                  torch.Size((b - a, *shape[1:])))
                            for i, (a, b) in enumerate(pairwise(cuts))]
            for i, piece in enumerate(pieces[name]):
                loads[i] += piece.numel
        else:
            whole.append((name, shape))
    for name, shape in sorted(whole, key=lambda item: -item[1].numel()):
        owner = loads.index(min(loads))
        loads[owner] += shape.numel()
        pieces[name] = [Piece(name, name, owner, 0, shape.numel(), shape)]
    return {name: pieces[name] for name in names}


class _PieceRoutes(Routes):
    """Routes a piece as the policy routes its whole tensor."""

    def __init__(self, routes: Routes) -> None:
        super().__init__(routes.scheme, routes.policy, routes.comm)
        self.whole: dict[str, torch.Size] = {}

    def _choose(self, name: str, shape: torch.Size) -> Scheme:
        return super()._choose(name, self.whole.get(name, shape))


class _CrossPipeline(Pipeline):
    """The pipeline across hosts, whose finite check also agrees inside the host (so every
    rank of the job commits the step or none does)."""

    host: Communicator
    tensor_of: dict[str, str]

    def _check_finite(self, flights: list[Any]) -> None:
        error: NonFiniteGradientError | None = None
        try:
            super()._check_finite(flights)
        except NonFiniteGradientError as exc:
            error = exc
        flag = torch.tensor([0.0 if error is None else 1.0])
        agreed = self.host.wait(self.host.start("hvdc.host.finite",
                                                AllReduce("finite", flag, inplace=True)))
        if error is not None:
            raise NonFiniteGradientError(
                sorted({self.tensor_of.get(n, n) for n in error.names}),
                sorted({self.tensor_of.get(n, n) for n in error.local}), error.step,
                error.rank)
        if float(agreed.sum()) > 0:
            step = max((self._steps[f.name] for f in flights), default=0)
            raise NonFiniteGradientError([], [], step, self.comm.rank)


@dataclass
class _Tensor:
    grad: torch.Tensor
    started: bool = False  # its sum inside the host
    handle: Any = None  # the all-to-all of that sum, or this rank's own part (one rank)
    forwarded: bool = False  # its pieces are in the pipeline across hosts


class HierarchicalPipeline:
    """:class:`~hvd_compress.pipeline.Pipeline`'s interface (``plan``, ``submit``, ``wait``,
    ``state_dict``...) for two-level compression (module docstring).

    Args:
        scheme: the compression scheme (not ``Compression.auto``).
        local: the communicator of this rank's host (``rank`` its local rank).
        cross: the communicator of this local rank on every host (``rank`` the host).
        policy, average, prescale, seed, report_every: as :class:`Pipeline`'s, for the whole
            job (``average`` divides by ``local.size * cross.size``).
        bucket_bytes: as :class:`Pipeline`'s, for whole tensors: pieces of a ``"slices"``
            split are bucketed by ``bucket_bytes / L`` so the buckets hold the same tensors.
        split: ``"slices"`` or ``"tensors"`` (default :func:`split_of` the scheme).
    """

    def __init__(self, scheme: Scheme, local: Communicator, cross: Communicator,
                 policy: Policy | None = None, average: bool = True, prescale: float = 1.0,
                 seed: int = 0, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                 report_every: int = DEFAULT_REPORT_EVERY, split: str | None = None) -> None:
        check_hierarchy("host", scheme)
        self.split = split or split_of(scheme)
        if self.split not in ("slices", "tensors"):
            raise ValueError(f"split must be 'slices' or 'tensors', got {self.split!r}")
        self.local, self.cross = local, cross
        self.size = local.size * cross.size
        self.average, self.prescale = average, prescale
        sliced = self.split == "slices" and bucket_bytes
        inner_bytes = max(1, bucket_bytes // local.size) if sliced else bucket_bytes
        self.inner = _CrossPipeline(scheme, cross, policy, average=False, prescale=1.0,
                                    seed=seed, bucket_bytes=inner_bytes,
                                    report_every=report_every)
        self.inner.host = local
        self.inner.tensor_of = {}
        self.inner.routes = self._routes = _PieceRoutes(self.inner.routes)
        self.scheme = scheme
        self._order: dict[str, int] = {}
        self._pieces: dict[str, list[Piece]] = {}
        self._loads = [0] * local.size
        self._tensors: dict[str, _Tensor] = {}
        self.bucket_bytes = bucket_bytes
        self._bucket_of: dict[str, int] = {}  # planned tensor -> its bucket (whole tensors)
        self._buckets: list[list[str]] = []
        self._complete: list[int] = []  # this step's complete buckets not yet forwarded
        self._current = StepStats()
        self.last_step = StepStats()
        self.total = StepStats()

    # Pipeline's interface -------------------------------------------------------------------
    @property
    def feedback(self) -> Any:
        return self.inner.feedback

    @property
    def routes(self) -> Routes:
        return self.inner.routes

    @property
    def comm(self) -> Communicator:
        return self.inner.comm

    @property
    def tensor_of(self) -> dict[str, str]:
        """The tensor of each piece name (residuals and scheme state are kept by piece)."""
        return dict(self.inner.tensor_of)

    @property
    def pending(self) -> bool:
        return bool(self._tensors)

    @property
    def buckets(self) -> list[list[str]]:
        """The buckets of this local rank's pieces across hosts."""
        return self.inner.buckets

    def pieces(self, name: str) -> list[Piece]:
        """The pieces of a planned (or already exchanged) tensor."""
        return list(self._pieces[name])

    def plan(self, names: Sequence[str], numels: Sequence[Sequence[int]],
             device: torch.device | str = "cpu") -> list[list[str]]:
        """As :meth:`Pipeline.plan`, with shapes (pieces need them): cuts the tensors into
        pieces and plans this local rank's pieces across hosts."""
        if self._tensors:
            raise RuntimeError("cannot change the plan while exchanges are in flight")
        shapes = [torch.Size(n) if not isinstance(n, int) else torch.Size((n,))
                  for n in numels]
        self._order = {name: i for i, name in enumerate(names)}
        self._buckets = assign_buckets(list(names), [s.numel() for s in shapes],
                                       self.bucket_bytes)
        self._bucket_of = {n: b for b, members in enumerate(self._buckets) for n in members}
        self._loads = [0] * self.local.size
        self._pieces = cut(list(names), shapes, self.local.size, self.split, self._loads)
        mine = self._register(list(names))
        return self.inner.plan([p.key for p in mine], [p.shape for p in mine], device)

    def _register(self, names: list[str]) -> list[Piece]:
        """This local rank's pieces of ``names``, routed as their tensors."""
        mine = [p for n in names for p in self._pieces[n] if p.owner == self.local.rank]
        for n in names:
            for p in self._pieces[n]:
                self._routes.whole[p.key] = self._shape(n)
                self.inner.tensor_of[p.key] = n
        return mine

    def _shape(self, name: str) -> torch.Size:
        pieces = self._pieces[name]
        if len(pieces) == 1:
            return pieces[0].shape
        return torch.Size((sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]))

    def submit(self, name: str, grad: torch.Tensor) -> None:
        """Start the tensor's dense sum inside the host (at :meth:`wait` over a communicator
        matched by start order). When this completes a planned bucket (of whole tensors,
        ``bucket_bytes``), the bucket completed before it, whose sums have had a bucket's
        backward to finish, has its pieces handed to the pipeline across hosts (its first
        rounds start); the last bucket's go at :meth:`wait`."""
        if name in self._tensors:
            raise RuntimeError(f"tensor {name!r} was submitted twice in one step; call wait() "
                               "between steps")
        if grad.is_sparse or not grad.dtype.is_floating_point:
            raise TypeError(f"tensor {name!r}: hvd_compress exchanges dense floating-point "
                            f"gradients, got {grad.layout} {grad.dtype}")
        tensor = self._tensors[name] = _Tensor(grad)
        bucket = self._bucket_of.get(name)
        if bucket is None or getattr(self.local, "ordered", False):
            return  # started at wait(), in an order every rank reproduces
        self._start_sum(name, tensor)
        if not all(n in self._tensors for n in self._buckets[bucket]):
            return
        self._complete.append(bucket)
        while len(self._complete) > 1:
            for member in self._buckets[self._complete.pop(0)]:
                self._forward(member)

    def _forward(self, name: str) -> None:
        """Wait for the tensor's sum inside the host; submit this local rank's pieces of it
        across hosts."""
        tensor = self._tensors[name]
        if tensor.forwarded:
            return
        started = time.perf_counter()
        summed = sum_in_order([tensor.handle]) if self.local.size == 1 else \
            wait_sum(self.local, tensor.handle)
        self._current.seconds[f"wait {HOST_ROUND}"] += time.perf_counter() - started
        tensor.forwarded, tensor.handle = True, None
        mine = [p for p in self._pieces[name] if p.owner == self.local.rank]
        if not mine:
            return
        (piece,) = mine  # one piece of a tensor per local rank at most
        self.inner.submit(piece.key, summed.view(piece.shape))

    def _start_sum(self, name: str, tensor: _Tensor) -> None:
        """Start the tensor's sum inside the host as a reduce-scatter: an all-to-all that
        sends each local rank's piece to it (summed there, in local rank order)."""
        if name not in self._pieces:  # a tensor no plan named: cut now, on every rank alike
            self._pieces.update(cut([name], [tensor.grad.shape], self.local.size, self.split,
                                    self._loads))
            self._register([name])
        grad = tensor.grad
        x = (grad / self.prescale if self.prescale != 1.0 else grad).reshape(-1)
        tensor.started = True
        if self.local.size == 1:
            tensor.handle = x
            return
        splits = [0] * self.local.size  # pieces lie in local rank order
        for piece in self._pieces[name]:
            splits[piece.owner] += piece.numel
        tensor.handle = self.local.start(f"hvdc.host.{name}",
                                         AllToAll(HOST_ROUND, x, tuple(splits)))
        self._current.collective_bytes[HOST_ROUND] += x.numel() * x.element_size()
        self._current.collectives += 1

    def _sorted(self, names: Sequence[str]) -> list[str]:
        """Plan order, then unplanned tensors by name: the same on every rank."""
        return sorted(names, key=lambda n: (self._order.get(n, len(self._order)), n))

    def wait(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """As :meth:`Pipeline.wait`: every rank of the job gets the same aggregates, and a
        non-finite one raises :class:`NonFiniteGradientError` on every rank with no state
        changed. Over shared memory, ``last_step.seconds["peers host"]`` is the part of the
        step spent waiting for the host's other ranks to reach a collective."""
        tensors = self._tensors
        names = self._sorted(list(tensors))
        waited = getattr(self.local, "barrier_seconds", None)  # shared memory's waits
        try:
            for name in names:
                if not tensors[name].started:
                    self._start_sum(name, tensors[name])
            for name in names:
                self._forward(name)
        finally:
            self._tensors, self._complete = {}, []
            stats, self._current = self._current, StepStats()
        results = self.inner.wait()
        stats.add(self.inner.last_step)
        started = time.perf_counter()
        flat = self._gather(names, tensors, results, stats)
        stats.seconds[f"wait {HOST_ROUND}"] += time.perf_counter() - started
        if waited is not None:  # of which waiting for the host's other ranks
            stats.seconds[f"peers {HOST_ROUND}"] += self.local.barrier_seconds - waited
        into = into or {}
        scale = self.prescale / (self.size if self.average else 1)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            grad = tensors[name].grad
            target = into.get(name)
            value = flat[name].view(grad.shape)
            if target is not None:
                out[name] = write_scaled(value, target, scale)
            else:
                out[name] = (value * scale if scale != 1.0 else value).to(grad.dtype)
        self.total.add(stats)
        self.last_step = stats
        return out

    def _gather(self, names: list[str], tensors: Mapping[str, _Tensor],
                results: Mapping[str, torch.Tensor], stats: StepStats
                ) -> dict[str, torch.Tensor]:
        """Every tensor's aggregate (flat, in its gradient's dtype), the local ranks' pieces
        all-gathered inside the host, one all-gather per dtype."""
        flat = {n: buffers.empty(tensors[n].grad.numel(), tensors[n].grad.dtype,
                                 tensors[n].grad.device) for n in names}
        by_dtype: dict[torch.dtype, list[Piece]] = {}
        for name in names:
            by_dtype.setdefault(flat[name].dtype, []).extend(self._pieces[name])
        for dtype, pieces in by_dtype.items():
            sizes = [0] * self.local.size
            for p in pieces:
                sizes[p.owner] += p.numel
            mine = [results[p.key].reshape(-1) for p in pieces if p.owner == self.local.rank]
            device = flat[pieces[0].tensor].device
            sent = buffers.cat(mine) if mine else torch.empty(0, dtype=dtype, device=device)
            places: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(self.local.size)]
            offsets = [0] * self.local.size  # each piece's place in its owner's payload
            for p in pieces:
                places[p.owner].append((offsets[p.owner], flat[p.tensor][p.start:p.stop]))
                offsets[p.owner] += p.numel
            if self.local.size == 1:
                parts = [sent]
            else:
                stats.collective_bytes[HOST_ROUND] += sent.numel() * sent.element_size()
                stats.collectives += 1
                handle = self.local.start(f"hvdc.host.gather.{dtype}",
                                          AllGather(HOST_ROUND, sent, tuple(sizes)))
                if hasattr(self.local, "wait_into"):  # straight into place (shared memory)
                    self.local.wait_into(handle, places)
                    continue
                parts = list(self.local.wait(handle))
            for owner, placed in enumerate(places):
                for at, target in placed:
                    target.copy_(parts[owner][at:at + target.numel()])
        return flat

    def reduce(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Submit every tensor, then wait (as :meth:`Pipeline.reduce`)."""
        for name, tensor in tensors.items():
            self.submit(name, tensor)
        return self.wait()

    # State -----------------------------------------------------------------------------------
    def layout(self) -> dict[str, Any]:
        return layout_of(self.local, self.cross, self.split)

    def state_dict(self) -> dict[str, Any]:
        """The cross-host pipeline's state (this local rank's pieces' residuals and scheme
        state) and the layout it holds for."""
        return {**self.inner.state_dict(), "hierarchy": self.layout()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(check_layout(state, self.layout()))
