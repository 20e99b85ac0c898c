"""The one path every tensor takes, whatever the scheme.

Per tensor and step::

    gradient -> policy (compress or send dense) -> add residual -> scheme.exchange
             -> [collective rounds: a bucket's requests of one round fused, started
                 asynchronously]
             -> aggregate -> check finite on every rank -> commit residual and state
             -> report the compression error -> average -> gradient for the optimizer

Every compressed tensor's compression error is reported (``feedback.report()``): with error
feedback the residual update measures it; without, :meth:`Pipeline._report` does, from the
scheme's own decoded contribution or, for a compressed all-reduce, from the payload this
rank sent, kept as it passed (:func:`~hvd_compress.feedback.watch_scatter`).

Buckets and fused rounds
------------------------
Every Horovod collective costs a negotiation with Horovod's coordinator and its own
latency, whatever its size; on a slow, high-latency or CPU-starved cluster that, not the
bytes, dominates the step of a model with many tensors. PyTorch DDP's ``powerSGD_hook``
therefore flattens all ``P`` matrices of a bucket into one all-reduce and all ``Q`` matrices
into another. The pipeline does the same for every scheme, in this one place: schemes still
yield one request per round (:mod:`hvd_compress.comm.ops`) and never see the fusion.

1. :meth:`Pipeline.plan` lists the tensors in the order their gradients are expected to
   become ready (backward order). Consecutive tensors form buckets of at most
   ``bucket_bytes`` float32 bytes; a larger tensor is a bucket of its own
   (:func:`assign_buckets`, DDP's assignment). Tensors that no plan names (a plan-less
   :meth:`Pipeline.reduce`) are bucketed the same way when :meth:`Pipeline.wait` is
   called, in sorted-name order.
2. :meth:`Pipeline.submit` runs a tensor's exchange up to its first request. Once every
   member of a planned bucket has been submitted, the bucket's first *phase* starts, so the
   last layers' bucket is in flight while backward still runs for the first layers.
3. Phase ``k`` of a bucket is its members' ``k``-th requests. Those of the same kind, dtype
   and device travel as one collective (:func:`fusion_key`, :func:`fuse`): all-reduces are
   concatenated (a dense bias's ``dense`` round and PowerSGD's ``P`` share one, as in DDP),
   all-gathers with known ``sizes`` are concatenated and their results cut per rank,
   all-to-alls are concatenated per destination. A :class:`~hvd_compress.comm.ops.SparseSum`
   (its communicator may send it to a parameter server keyed by the tensor) and a
   self-delimiting all-gather (``sizes=None``) travel alone, as does a request that is the
   only one of its kind in the phase. Members whose exchange has ended drop out of later
   phases.
4. :meth:`Pipeline.wait` starts the buckets not yet started, then drives all of them phase
   by phase, in launch order: it waits on a phase's collectives, hands every member its
   slice (:func:`split_result`), which runs the member's exchange to its next request, and
   starts the bucket's next phase at once. It waits only on started collectives, and each
   rank starts phase ``k + 1`` of a bucket as soon as phase ``k`` is done, so ranks whose
   backward passes completed the buckets in different orders cannot deadlock. A
   communicator that matches collectives by start order rather than by name
   (:class:`~hvd_compress.comm.gloo_torch.GlooCommunicator`, ``ordered``) gets them in an
   order every rank reproduces: complete buckets start in plan order only, as DDP's do.

Fusion changes no result: an all-reduce sums each element over the same ranks whether its
neighbours in the buffer belong to its own tensor or to another. On
:class:`~hvd_compress.comm.threads.ThreadGroup` fused and unfused aggregates are bit for bit
identical; under Horovod they differ only by the summation order of its ring, which depends
on an element's position in the buffer (Horovod's own tensor fusion does the same). The cost
is one copy of each request into the fused buffer; the results are views of the fused
result, without a copy.

Collective names
----------------
Horovod matches collectives by name, so names are deterministic and identical on every
rank: ``hvdc.b<bucket>.<phase>.<kind>.<digest>`` for a fused collective, where ``<digest>``
hashes the members' names, round names and sizes and the dtype, and
``hvdc.<tensor>.<round>`` for a request travelling alone. Names are unique within a step
and repeat from step to step, as Horovod's own names do (that keeps Horovod's response
cache and the TensorFlow binding's traced graphs valid). Ranks that disagree on a bucket's
content (different plans, a tensor submitted on one rank only, another shape) start
different names: Horovod's stall warning then lists them (a ``ThreadGroup`` raises a
``TimeoutError`` naming them) instead of ranks summing misaligned slices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, nbytes
from hvd_compress.errors import NonFiniteGradientError
from hvd_compress.feedback import ErrorFeedback, KeepsResidual, payload_distance, watch_scatter
from hvd_compress.native import buffers
from hvd_compress.policy import Policy
from hvd_compress.schemes import auto as auto_routes
from hvd_compress.schemes.auto import Auto
from hvd_compress.schemes.base import (
    Exchange,
    ExchangeContext,
    Outcome,
    Scattered,
    Scheme,
    materialize,
    total,
    write_scaled,
)
from hvd_compress.schemes.dense import FP16, NoCompression
from hvd_compress.schemes.packed import PackedScheme

STATE_VERSION = 1
DEFAULT_BUCKET_BYTES = 64 << 20
"""64 MiB, Horovod's default fusion threshold (``HOROVOD_FUSION_THRESHOLD``)."""

DEFAULT_REPORT_EVERY = 10
"""Steps between measurements of the compression error of a tensor without error feedback
(``report_every`` of :class:`Pipeline` and of every binding's wrapper)."""
_DENSE = NoCompression()

Result = torch.Tensor | list[torch.Tensor]
T = TypeVar("T")


@dataclass
class StepStats:
    """Bytes of one step on this rank, all measured from the tensors actually handed over.

    ``payload_bytes``: encoded size of this rank's gradients (what a ring all-reduce would
    circulate; the wire-saving ratio is ``dense_bytes / payload_bytes``). ``dense_bytes``:
    the same gradients as float32. ``collective_bytes``: bytes of each tensor's requests,
    by round name (``dense``, ``fp16``, ``scatter``, ``gather``, ``P``, ``Q``...), counted
    per tensor whether or not the request travelled fused with others. ``collectives``:
    collectives started (a fused one counts once), i.e. Horovod negotiations.
    ``seconds``: where this rank's time went, by part: ``feedback`` (adding residuals),
    ``scheme`` (the schemes' own code: encoding, decoding, products), ``fuse`` (cutting and
    joining fused requests and starting collectives), ``wait <round>`` (blocked until a
    round's collectives finished: the transfer, Horovod's negotiation and cycle, and the
    slowest rank), ``commit`` (finite check, residuals, writing the aggregates), ``report``
    (the compression error of the tensors without error feedback, whose residual update
    does not measure it: :meth:`~hvd_compress.feedback.ErrorFeedback.observe_sent`).
    ``sparse_entries``: the entries of the tensors a sparse scheme sent as (index, value)
    pairs (top-k, random-k, threshold, DGC); ``sent_entries``: the pairs this rank sent for
    them; ``density``: ``sent_entries / sparse_entries``, the fraction of those tensors'
    entries that travelled (fixed by the ratio for top-k, random-k and DGC after warm-up;
    following the gradients for threshold), ``None`` when no tensor went sparse.
    """

    payload_bytes: int = 0
    dense_bytes: int = 0
    collective_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    compressed_tensors: int = 0
    dense_tensors: int = 0
    collectives: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sparse_entries: int = 0
    sent_entries: int = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes / max(self.payload_bytes, 1)

    @property
    def density(self) -> float | None:
        return self.sent_entries / self.sparse_entries if self.sparse_entries else None

    def add(self, other: StepStats) -> None:
        self.payload_bytes += other.payload_bytes
        self.dense_bytes += other.dense_bytes
        self.compressed_tensors += other.compressed_tensors
        self.dense_tensors += other.dense_tensors
        self.collectives += other.collectives
        self.sparse_entries += other.sparse_entries
        self.sent_entries += other.sent_entries
        for key, value in other.collective_bytes.items():
            self.collective_bytes[key] += value
        for key, seconds in other.seconds.items():
            self.seconds[key] += seconds


# Buckets and fusion -------------------------------------------------------------------------
def assign_buckets(names: Sequence[str], numels: Sequence[int],
                   bucket_bytes: int | None) -> list[list[str]]:
    """Cut ``names`` (in order) into consecutive buckets of at most ``bucket_bytes`` float32
    bytes (``4 * numel`` each), as DDP assigns parameters to buckets.

    A tensor that does not fit in the current bucket starts the next one; a tensor larger
    than ``bucket_bytes`` is a bucket of its own. ``None`` or 0: a single bucket.
    """
    buckets: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, numel in zip(names, numels, strict=True):
        size = 4 * int(numel)
        if current and bucket_bytes and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def fusion_key(request: Collective) -> tuple[str, torch.dtype, torch.device] | None:
    """Requests with equal keys may travel as one collective; ``None``: never fused.

    :class:`~hvd_compress.comm.ops.SparseSum` is not fused (its communicator may send it to
    a parameter server that keys rounds by tensor), nor is a self-delimiting
    :class:`~hvd_compress.comm.ops.AllGather` (``sizes=None``: there is no way to tell
    where one member's part of a rank's bytes ends).
    """
    if isinstance(request, AllReduce):
        kind = "allreduce"
    elif isinstance(request, AllGather) and request.sizes is not None:
        kind = "allgather"
    elif isinstance(request, AllToAll):
        kind = "alltoall"
    else:
        return None
    return kind, request.tensor.dtype, request.tensor.device


def fused_name(bucket: int, phase: int, names: Sequence[str],
               requests: Sequence[Collective]) -> str:
    """``hvdc.b<bucket>.<phase>.<kind>.<digest>``: the same on every rank that agrees on
    the members, their rounds and sizes (not a device index, which differs between ranks)."""
    key = fusion_key(requests[0])
    assert key is not None
    digest = hashlib.blake2b(digest_size=4)
    digest.update(str(key[1]).encode())
    for name, request in zip(names, requests, strict=True):
        if isinstance(request, AllToAll):  # sizes are checked when the result arrives
            extent: Any = len(request.splits)
        elif isinstance(request, AllGather):
            extent = request.sizes
        else:
            extent = request.tensor.numel()
        digest.update(f"\0{name}\0{request.round}\0{extent}".encode())
    return f"hvdc.b{bucket}.{phase}.{key[0]}.{digest.hexdigest()}"


def _all(requests: Sequence[Collective], kind: type[T]) -> list[T]:
    """``requests`` typed as their (common) kind."""
    typed = [r for r in requests if isinstance(r, kind)]
    assert len(typed) == len(requests), f"mixed requests in one fused group: {requests}"
    return typed


def fuse(requests: Sequence[Collective], rank: int, size: int, where: str) -> Collective:
    """One request carrying all of ``requests`` (equal :func:`fusion_key`), in order.

    * :class:`AllReduce`: the flattened tensors concatenated.
    * :class:`AllGather`: the flat tensors concatenated; rank ``r`` contributes
      ``sum(req.sizes[r])`` elements.
    * :class:`AllToAll`: for each destination ``r``, every member's split ``r`` in turn;
      ``splits[r]`` is the members' total for ``r``.

    The fused request's round is the members' distinct round names joined by ``+``. The
    concatenation goes into recycled memory (:func:`hvd_compress.native.buffers.cat`), lent
    to one tensor and its views at a time, and a fused all-reduce may sum in place into it,
    so a step touches no fresh pages (a page fault per 4 KiB on first touch) and a result or
    state that is a view of a fused buffer keeps it from being lent again.
    Raises :class:`RuntimeError` naming ``where`` if a member's sizes do not describe its
    own tensor (a scheme bug the unfused path would have hit in the collective).
    """
    round_name = "+".join(dict.fromkeys(r.round for r in requests))
    if isinstance(requests[0], AllReduce):
        reduces = _all(requests, AllReduce)
        return AllReduce(round_name, buffers.cat([r.tensor for r in reduces]), inplace=True)
    if isinstance(requests[0], AllGather):
        gathers = _all(requests, AllGather)
        known: list[tuple[int, ...]] = []
        for r in gathers:
            if r.sizes is None or len(r.sizes) != size or r.sizes[rank] != r.tensor.numel():
                raise RuntimeError(f"{where}: all-gather round {r.round!r} has "
                                   f"{r.tensor.numel()} elements on rank {rank} but sizes "
                                   f"{r.sizes} for {size} ranks")
            known.append(r.sizes)
        sizes = tuple(sum(s[k] for s in known) for k in range(size))
        return AllGather(round_name, buffers.cat([r.tensor for r in gathers]), sizes)
    scatters = _all(requests, AllToAll)
    pieces = []
    for r in scatters:
        if len(r.splits) != size or sum(r.splits) != r.tensor.numel():
            raise RuntimeError(f"{where}: all-to-all round {r.round!r} has "
                               f"{r.tensor.numel()} elements but splits {list(r.splits)} for "
                               f"{size} ranks")
        pieces.append(torch.split(r.tensor.reshape(-1), list(r.splits)))
    tensor = buffers.cat([p[dest] for dest in range(size) for p in pieces])
    splits = tuple(sum(r.splits[dest] for r in scatters) for dest in range(size))
    return AllToAll(round_name, tensor, splits)


def split_result(requests: Sequence[Collective], result: Result, rank: int, size: int,
                 where: str) -> list[Result]:
    """Cut the result of :func:`fuse`'s request back into one result per member, each in
    the form its own request documents (views of ``result``, no copies).

    For :class:`AllToAll` this relies on its contract (:mod:`hvd_compress.comm.ops`): every
    sender uses the same ``splits``, so member ``m``'s piece from any source has
    ``m.splits[rank]`` elements. A source whose total differs raises :class:`RuntimeError`
    naming ``where`` instead of cutting wrongly. (A sender that divided the same total
    among the members differently cannot be told apart by sizes alone; the contract rules
    it out.)
    """
    if isinstance(requests[0], AllReduce):
        assert isinstance(result, torch.Tensor)
        reduces = _all(requests, AllReduce)
        numels = [r.tensor.numel() for r in reduces]
        flat = result.reshape(-1)
        if flat.numel() != sum(numels):
            raise RuntimeError(f"{where}: the fused all-reduce returned {flat.numel()} "
                               f"elements, expected {sum(numels)}")
        return [piece.view(r.tensor.shape) for piece, r in zip(torch.split(flat, numels),
                                                                reduces)]
    assert isinstance(result, list)
    if len(result) != size:
        raise RuntimeError(f"{where}: the fused collective returned {len(result)} parts for "
                           f"{size} ranks")
    if isinstance(requests[0], AllGather):
        known = [r.sizes for r in _all(requests, AllGather) if r.sizes is not None]
        lengths = [[s[source] for s in known] for source in range(size)]
        what = "gathered from"
    else:
        mine = [r.splits[rank] for r in _all(requests, AllToAll)]
        lengths = [mine] * size
        what = "received from"
    parts = []
    for source, (piece, expected) in enumerate(zip(result, lengths)):
        if piece.numel() != sum(expected):
            raise RuntimeError(
                f"{where}: rank {rank} {what} rank {source} {piece.numel()} elements, but the "
                f"members expect {sum(expected)} ({expected} per tensor). AllToAll splits and "
                "AllGather sizes must be the same on every rank (a function of what every "
                "rank knows, such as the shape) for requests to be fused; see "
                "hvd_compress.comm.ops")
        parts.append(torch.split(piece.reshape(-1), expected))
    return [[parts[source][i] for source in range(size)] for i in range(len(requests))]


# The pipeline -------------------------------------------------------------------------------
@dataclass
class _InFlight:
    """One tensor's exchange in this step."""

    name: str
    grad: torch.Tensor
    x: torch.Tensor
    scheme: Scheme
    exchange: Exchange
    feedback: bool = False  # x is g + e: the residual is committed with the outcome
    request: Collective | None = None  # yielded by the exchange, not yet started
    outcome: Outcome | None = None
    codec: PackedScheme | None = None  # a compressed all-reduce without error feedback
    scatter: AllToAll | None = None  # its payload, for the compression error

    def keep_scatter(self, request: AllToAll) -> None:
        self.scatter = request


@dataclass
class _Group:
    """One started collective and the members whose requests it carries, in order."""

    name: str
    members: list[_InFlight]
    requests: list[Collective]
    handle: Any


@dataclass
class _Bucket:
    """A bucket in this step: its members (in plan order once launched) and its current
    phase's collectives."""

    index: int
    expected: int  # members the plan names
    members: list[_InFlight] = field(default_factory=list)
    phase: int = 0
    groups: list[_Group] = field(default_factory=list)
    launched: bool = False

    def describe(self) -> str:
        return f"bucket {self.index} phase {self.phase}"


class Pipeline:
    """Compress, communicate and aggregate named tensors with one scheme.

    Args:
        scheme: the compression scheme (see :class:`hvd_compress.Compression`).
        comm: the communicator (Horovod's, or a :class:`~hvd_compress.comm.threads.ThreadGroup`
            rank in tests).
        policy: which tensors are compressed; the rest go as a plain all-reduce (default
            :class:`~hvd_compress.policy.Policy`: at least 1024 elements, 2-D or more).
        average: divide the sum by the number of ranks (default ``True``).
        prescale: divide inputs by this before communicating and multiply results by it
            after (Horovod's ``gradient_predivide_factor``: keeps float16 sums in range).
            Default 1.
        seed: base of every random stream (stochastic rounding, PowerSGD's first ``Q``);
            the same on every rank. Default 0.
        bucket_bytes: the most float32 gradient bytes whose requests share collectives
            (see the module docstring). Default 64 MiB, Horovod's default fusion threshold.
            Larger buckets mean fewer collectives (fewer negotiations and latencies per
            step); smaller ones let the first buckets travel earlier while backward still
            runs. ``None`` or 0: one bucket for the step, started only once every planned
            tensor has been submitted. A tiny value (1) gives one collective per tensor and
            round, the behaviour without fusion.
        report_every: how often ``feedback.report()`` is refreshed. A tensor without error
            feedback has its compression error measured
            (:meth:`~hvd_compress.feedback.ErrorFeedback.observe_sent`) at every
            ``report_every``-th step (its first included); a tensor with error feedback has
            its norms measured at each of its first ``window`` steps (they set the growth
            warning's reference, :class:`~hvd_compress.feedback.ErrorFeedback`), then at
            every ``report_every``-th; DGC's velocity (one norm at hand) at every step. 0:
            never, beyond the error-feedback window. Default 10; 1 measures every step.
            A measurement reads the tensor once or twice (a compressed all-reduce also
            decodes its own payload) and waits for the result on the host, so it is kept
            off most steps; see docs/results/overhead for what it costs.
    """

    def __init__(self, scheme: Scheme, comm: Communicator, policy: Policy | None = None,
                 average: bool = True, prescale: float = 1.0, seed: int = 0,
                 bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                 report_every: int = DEFAULT_REPORT_EVERY) -> None:
        if prescale <= 0:
            raise ValueError(f"prescale must be positive, got {prescale}")
        if isinstance(report_every, bool) or not isinstance(report_every, int) \
                or report_every < 0:
            raise ValueError(f"report_every must be a number of steps >= 0 (0: never "
                             f"measure), got {report_every!r}")
        if bucket_bytes is not None and bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0 or None, got {bucket_bytes}")
        self.scheme = scheme
        self.comm = comm
        self.policy = policy if policy is not None else Policy()
        self.average = average
        self.prescale = prescale
        self.seed = seed
        self.bucket_bytes = bucket_bytes or None
        self.report_every = report_every
        self.feedback = ErrorFeedback.for_scheme(scheme)
        self._scheme_state: dict[str, dict[str, torch.Tensor]] = {}
        self._steps: dict[str, int] = defaultdict(int)
        self._routes: dict[tuple[str, torch.Size], Scheme] = {}
        self._auto = scheme if isinstance(scheme, Auto) else None
        self._auto_shapes: dict[str, torch.Size] = {}  # every tensor auto has routed
        self._auto_window: list[float] = []  # measured exchange seconds since the decision
        self.auto_decision: auto_routes.Decision | None = None
        """``Compression.auto``'s routes and the measurements they were decided from."""
        self._plan: list[list[str]] = []
        self._position: dict[str, tuple[int, int]] = {}  # name -> (bucket, place in it)
        # This step:
        self._inflight: dict[str, _InFlight] = {}
        self._open: dict[int, _Bucket] = {}  # planned buckets with a submitted member
        self._unplanned: list[_InFlight] = []
        self._launched: list[_Bucket] = []
        # A communicator that matches collectives by start order gets planned buckets in
        # plan order only; this is the next one it starts.
        self._ordered = bool(getattr(comm, "ordered", False))
        self._next_bucket = 0
        self._failure: BaseException | None = None
        self._current = StepStats()
        self.last_step = StepStats()
        self.total = StepStats()

    # Routing and planning ------------------------------------------------------------------
    def route(self, name: str, shape: torch.Size) -> Scheme:
        """The scheme a tensor of this name and shape travels with (cached)."""
        key = (name, shape)
        scheme = self._routes.get(key)
        if scheme is None:
            if self._auto is not None:
                scheme = self._auto_route(name, shape)
            else:
                compress = self.policy.compresses(self.scheme, shape)
                scheme = self.scheme if compress else _DENSE
            self._routes[key] = scheme
        return scheme

    def _auto_route(self, name: str, shape: torch.Size) -> Scheme:
        """``Compression.auto``'s route for a tensor; dense until it has been decided (at
        the end of the step that first carries it)."""
        assert self._auto is not None
        self._auto_shapes[name] = shape
        decision = self.auto_decision
        if decision is None or decision.shapes.get(name) != shape:
            return _DENSE
        route = decision.routes[name]
        return _DENSE if route == auto_routes.DENSE else self._auto.candidates()[route]

    def redecide(self, link: auto_routes.LinkModel | None = None,
                 device: torch.device | str = "cpu") -> auto_routes.Decision:
        """Measure again (the link too, unless ``link`` is given) and decide
        ``Compression.auto``'s routes for every tensor it has seen, keeping current routes
        unless another is clearly cheaper. Collectives: every rank calls it at the same
        point, between steps."""
        if self._auto is None:
            raise TypeError(f"redecide() needs Compression.auto, this pipeline uses "
                            f"{self.scheme!r}")
        if self._inflight:
            raise RuntimeError("cannot decide routes while exchanges are in flight; call "
                               "wait() first")
        self._auto_decide(dict(self._auto_shapes), torch.device(device), link,
                          self.auto_decision)
        assert self.auto_decision is not None
        return self.auto_decision

    def _auto_decide(self, shapes: Mapping[str, torch.Size], device: torch.device,
                     link: auto_routes.LinkModel | None = None,
                     current: auto_routes.Decision | None = None) -> None:
        """Measure and decide ``Compression.auto``'s routes: collectives every rank runs
        at the same point (plan or the end of a step)."""
        assert self._auto is not None
        self.auto_decision = self._auto.decide(
            shapes, self._auto_allowed, self._run_now, self.comm.rank, self.comm.size, device,
            link=link, current=current)
        self._auto_shapes.update(shapes)
        self._auto_window.clear()
        self._routes.clear()

    def _auto_after_step(self, flights: Sequence[_InFlight], stats: StepStats) -> None:
        """Decide routes for tensors first seen this step; every ``recheck_every`` steps,
        compare the measured exchange time with the prediction (:meth:`Auto.revise`)."""
        assert self._auto is not None
        auto = self._auto
        if not flights:
            return
        device = flights[0].grad.device
        decision = self.auto_decision
        if decision is None or any(decision.shapes.get(n) != s
                                   for n, s in self._auto_shapes.items()):
            self._auto_decide(dict(self._auto_shapes), device,
                              decision.link if decision is not None else None, decision)
            return
        self._auto_window.append(sum(seconds for part, seconds in stats.seconds.items()
                                     if part in ("scheme", "fuse") or part.startswith("wait")))
        if not auto.recheck_every or len(self._auto_window) < auto.recheck_every:
            return
        local = torch.tensor([sum(self._auto_window) / len(self._auto_window)],
                             dtype=torch.float64, device=device)
        self._auto_window.clear()
        agreed = self._run_now("hvdc.auto.recheck", AllReduce("recheck", local))
        measured = float(agreed.cpu()[0]) / self.comm.size
        revised = auto.revise(decision, measured, dict(self._auto_shapes), self._auto_allowed,
                              self._run_now, self.comm.rank, self.comm.size, device)
        if revised is not None:
            self.auto_decision = revised
            self._routes.clear()

    def _auto_allowed(self, shape: torch.Size) -> bool:
        """Whether the policy lets ``Compression.auto``'s scheme take a tensor of ``shape``."""
        assert self._auto is not None
        return self.policy.compresses(self._auto.scheme, shape)

    def _run_now(self, name: str, op: Collective) -> Any:
        """Start one collective and wait for it (``Compression.auto``'s measurements)."""
        return self.comm.wait(self.comm.start(name, op))

    def plan(self, names: Sequence[str], numels: Sequence[int | Sequence[int]],
             device: torch.device | str = "cpu") -> list[list[str]]:
        """Declare the tensors in the order their gradients are expected to become ready;
        return the buckets (:func:`assign_buckets` with ``bucket_bytes``).

        The plan must be the same on every rank. It replaces any earlier plan and holds for
        every following step. A bucket's first round starts as soon as all its members are
        submitted; a bucket some of whose members were not submitted starts at
        :meth:`wait` with those that were (every rank must submit the same tensors).

        ``numels`` may give each tensor's shape instead of its element count. With shapes,
        ``Compression.auto`` measures and decides its routes now, with collectives that
        every rank runs here (on ``device``, where the gradients will be); without, after
        the first step, which then travels dense.
        """
        shapes = None
        if numels and all(not isinstance(n, int) for n in numels):
            shapes = [torch.Size(n) for n in numels]  # type: ignore[arg-type]
            numels = [s.numel() for s in shapes]
        if self._inflight:
            raise RuntimeError("cannot change the plan while exchanges are in flight; call "
                               "wait() first")
        names, numels = list(names), [int(n) for n in numels]
        if len(names) != len(numels):
            raise ValueError(f"plan: {len(names)} names but {len(numels)} element counts")
        duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
        if duplicates:
            raise ValueError(f"plan: tensor names must be unique; duplicated: {duplicates}")
        if any(n < 0 for n in numels):
            raise ValueError(f"plan: element counts must be >= 0, got {numels}")
        self._plan = assign_buckets(names, numels, self.bucket_bytes)
        self._position = {name: (b, i) for b, members in enumerate(self._plan)
                          for i, name in enumerate(members)}
        if self._auto is not None and shapes is not None:
            self._auto_decide(dict(zip(names, shapes, strict=True)), torch.device(device))
        return self.buckets

    @property
    def buckets(self) -> list[list[str]]:
        """The planned buckets' tensor names, in plan order."""
        return [list(members) for members in self._plan]

    # Submitting and waiting ----------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return bool(self._inflight)

    def submit(self, name: str, grad: torch.Tensor) -> None:
        """Run ``grad``'s exchange up to its first request and return; start its bucket's
        first round if ``grad`` completes a planned bucket.

        If the exchange or a start fails, the error propagates and the whole step fails:
        :meth:`wait` then raises and no tensor's state changes.
        """
        if name in self._inflight:
            raise RuntimeError(f"tensor {name!r} was submitted twice in one step; call wait() "
                               "between steps (is the same name used for two tensors?)")
        if grad.is_sparse:
            raise TypeError(f"tensor {name!r} is a sparse tensor; hvd_compress compresses dense "
                            "gradients (pass sparse_as_dense=True to the optimizer)")
        if not grad.dtype.is_floating_point:
            raise TypeError(f"tensor {name!r} has dtype {grad.dtype}; only floating-point "
                            "gradients can be compressed or averaged")
        scheme = self.route(name, grad.shape)
        started = time.perf_counter()
        x = grad / self.prescale if self.prescale != 1.0 else grad
        # A residual left by a route that changed (Compression.auto) travels once more.
        feedback = scheme.error_feedback or self.feedback.get(name) is not None
        if feedback:
            x = self.feedback.compensate(name, x)
        elif scheme is not _DENSE:
            x = x.float()
        self._current.seconds["feedback"] += time.perf_counter() - started
        ctx = ExchangeContext(name, self.comm.rank, self.comm.size, self._steps[name],
                              self.seed)
        exchange = scheme.exchange(x, self._scheme_state.get(name, {}), ctx)
        flight = _InFlight(name, grad, x, scheme, exchange, feedback)
        codec = None if feedback else self._packed_codec(scheme, x.device)
        if codec is not None and self._reports(name, scheme):
            # Keep the payload it sends: its error is measured from it once the step is good.
            flight.codec = codec
            flight.exchange = watch_scatter(exchange, flight.keep_scatter)
        self._inflight[name] = flight
        try:
            if grad.numel() == 0:  # nothing to send; every rank agrees since shapes agree
                exchange.close()
                flight.outcome = Outcome(torch.zeros_like(x), None, 0)
            else:
                self._advance(flight, None)
            self._place(flight)
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
            raise

    def wait(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Finish every submitted exchange; return each tensor's aggregate.

        ``into`` maps tensor names to tensors of their shape (the gradients themselves, say)
        that receive the aggregates, scaled and cast in one pass, and are returned as them.

        Starts the buckets not started yet (planned ones in plan order, then the tensors no
        plan names), then drives every bucket phase by phase. Aggregates have the gradient's
        shape and dtype and are averaged when ``average``. If any aggregate is non-finite,
        raises :class:`NonFiniteGradientError` on every rank and keeps all residuals and
        scheme state as they were before the step; any other failure (an exchange raising,
        a collective failing) also leaves them unchanged.
        """
        flights = list(self._inflight.values())
        try:
            if self._failure is not None:
                raise RuntimeError(f"this step failed while its tensors were submitted "
                                   f"({self._failure!r}); no compression state was "
                                   "changed") from self._failure
            for index in sorted(self._open):
                if not self._open[index].launched:
                    self._launch(self._open[index])
            self._launch_unplanned()
            active = [b for b in self._launched if b.groups]
            while active:
                for bucket in active:
                    self._finish_phase(bucket)
                active = [b for b in active if b.groups]
            assert all(f.outcome is not None for f in flights)
        except BaseException:
            self._current = StepStats()
            raise
        finally:
            self._inflight.clear()
            self._open.clear()
            self._unplanned.clear()
            self._launched.clear()
            self._next_bucket = 0
            self._failure = None
        started = time.perf_counter()
        try:
            self._check_finite(flights)
        except NonFiniteGradientError:
            self._current = StepStats()
            raise
        self._current.seconds["commit"] += time.perf_counter() - started
        return self._commit(flights, into or {})

    def reduce(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Submit every tensor, then wait: one step's exchange outside an optimizer.

        Without a plan the tensors are bucketed by sorted name when :meth:`wait` runs.
        """
        for name, tensor in tensors.items():
            self.submit(name, tensor)
        return self.wait()

    def _advance(self, flight: _InFlight, result: Any) -> None:
        """Run the exchange to its next request (kept to be started) or to its end."""
        started = time.perf_counter()
        try:
            flight.request = flight.exchange.send(result)
        except StopIteration as done:
            flight.request, flight.outcome = None, done.value
        finally:
            self._current.seconds["scheme"] += time.perf_counter() - started

    def _place(self, flight: _InFlight) -> None:
        position = self._position.get(flight.name)
        if position is None:
            self._unplanned.append(flight)
            return
        index = position[0]
        bucket = self._open.get(index)
        if bucket is None:
            bucket = self._open[index] = _Bucket(index, len(self._plan[index]))
        bucket.members.append(flight)
        if not self._ordered:
            if len(bucket.members) == bucket.expected:
                self._launch(bucket)
            return
        # Complete buckets start in plan order only, as DDP's do, so that every rank
        # starts the same sequence.
        while (ready := self._open.get(self._next_bucket)) is not None \
                and len(ready.members) == ready.expected:
            self._launch(ready)
            self._next_bucket += 1

    def _launch_unplanned(self) -> None:
        flights = sorted(self._unplanned, key=lambda f: f.name)
        by_name = {f.name: f for f in flights}
        names = assign_buckets(list(by_name), [f.grad.numel() for f in flights],
                               self.bucket_bytes)
        for i, members in enumerate(names):
            bucket = _Bucket(len(self._plan) + i, len(members), [by_name[n] for n in members])
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.members.sort(key=lambda f: self._position.get(f.name, (0, 0)))
        bucket.launched = True
        self._launched.append(bucket)
        self._start_phase(bucket)

    def _start_phase(self, bucket: _Bucket) -> None:
        """Start the collectives of the bucket's current phase: one per fusion key (in the
        order of each key's first member), one per request that is never fused."""
        members: list[list[_InFlight]] = []
        by_key: dict[Any, list[_InFlight]] = {}
        for flight in bucket.members:
            if flight.request is None:
                continue  # exchange finished
            key = fusion_key(flight.request)
            if key is None:
                members.append([flight])
            elif key in by_key:
                by_key[key].append(flight)
            else:
                by_key[key] = [flight]
                members.append(by_key[key])
        bucket.groups = [self._start(bucket, group) for group in members]

    def _start(self, bucket: _Bucket, members: list[_InFlight]) -> _Group:
        started = time.perf_counter()
        requests: list[Collective] = []
        for flight in members:
            assert flight.request is not None
            requests.append(flight.request)
            self._current.collective_bytes[flight.request.round] += nbytes(flight.request)
            flight.request = None
        names = [f.name for f in members]
        if len(members) == 1:
            name, op = f"hvdc.{names[0]}.{requests[0].round}", requests[0]
        else:
            name = fused_name(bucket.index, bucket.phase, names, requests)
            op = fuse(requests, self.comm.rank, self.comm.size,
                      f"{bucket.describe()} ({name}, tensors {names})")
        handle = self.comm.start(name, op)
        self._current.collectives += 1
        self._current.seconds["fuse"] += time.perf_counter() - started
        return _Group(name, members, requests, handle)

    def _finish_phase(self, bucket: _Bucket) -> None:
        """Wait on the bucket's current collectives, advance their members, start the next
        phase."""
        for group in bucket.groups:
            started = time.perf_counter()
            result = self.comm.wait(group.handle)
            waited = time.perf_counter()
            rounds = "+".join(dict.fromkeys(r.round for r in group.requests))
            self._current.seconds[f"wait {rounds}"] += waited - started
            if len(group.members) == 1:
                parts = [result]
            else:
                where = (f"{bucket.describe()} ({group.name}, tensors "
                         f"{[f.name for f in group.members]})")
                parts = split_result(group.requests, result, self.comm.rank, self.comm.size,
                                     where)
            self._current.seconds["fuse"] += time.perf_counter() - waited
            for flight, part in zip(group.members, parts, strict=True):
                self._advance(flight, part)
        bucket.phase += 1
        self._start_phase(bucket)

    def _check_finite(self, flights: list[_InFlight]) -> None:
        """Raise :class:`NonFiniteGradientError` if any aggregate holds a NaN or an
        infinity.

        A sum is NaN or infinite whenever one of its terms is, so one sum per tensor (a
        single read, no tensor of flags) clears every finite aggregate; only a tensor whose
        sum is not finite (a non-finite element, or a sum beyond float32's range) is looked
        at element by element. One device-to-host transfer for the whole step.
        """
        if not flights:
            return
        sums = torch.stack([total(f.outcome.aggregate).to(torch.float32) for f in flights])
        finite = sums.isfinite().cpu().tolist()
        if all(finite):
            return
        bad = [f for f, ok in zip(flights, finite)
               if not ok and not bool(materialize(f.outcome.aggregate).isfinite().all())]
        if not bad:
            return
        local = [f.name for f in bad if not bool(f.x.isfinite().all())]
        step = max(self._steps[f.name] for f in bad)
        raise NonFiniteGradientError([f.name for f in bad], local, step, self.comm.rank)

    def _commit(self, flights: list[_InFlight],
                into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        results: dict[str, torch.Tensor] = {}
        stats = self._current
        scale = self.prescale / (self.comm.size if self.average else 1)
        for flight in flights:
            outcome = flight.outcome
            assert outcome is not None
            name, scheme = flight.name, flight.scheme
            if flight.feedback:
                sent = outcome.sent if scheme.error_feedback else None
                self.feedback.commit_sent(name, flight.x, sent, scheme.name,
                                          self.feedback.due(name, self.report_every))
            elif not isinstance(scheme, NoCompression) and self._reports(name, scheme):
                reported = time.perf_counter()
                self._report(flight, outcome)  # before _result may write into the gradient
                stats.seconds["report"] += time.perf_counter() - reported
            if outcome.state:
                self._scheme_state[name] = outcome.state
            self._steps[name] += 1
            results[name] = self._result(outcome, flight.grad, into.get(name), scale)
            stats.payload_bytes += outcome.payload_bytes
            stats.dense_bytes += 4 * flight.grad.numel()
            if isinstance(outcome.sent, Scattered):
                stats.sparse_entries += flight.grad.numel()
                stats.sent_entries += outcome.sent.indices.numel()
            if isinstance(scheme, NoCompression):
                stats.dense_tensors += 1
            else:
                stats.compressed_tensors += 1
        stats.seconds["commit"] += time.perf_counter() - started
        self.total.add(stats)
        self.last_step, self._current = stats, StepStats()
        if self._auto is not None:
            self._auto_after_step(flights, stats)
        return results

    def _reports(self, name: str, scheme: Scheme) -> bool:
        """Whether this step of ``name`` has its compression error measured: every
        ``report_every``-th step, or every step for a scheme keeping its own residual (DGC:
        one norm of a tensor at hand); tensors with error feedback always are."""
        if not self.report_every:
            return False
        return isinstance(scheme, KeepsResidual) or self._steps[name] % self.report_every == 0

    @staticmethod
    def _packed_codec(scheme: Scheme, device: torch.device) -> PackedScheme | None:
        """The codec of the compressed all-reduce a scheme without error feedback runs on
        ``device``: the scheme itself, or float16's payload on the CPU; else ``None``."""
        if isinstance(scheme, PackedScheme):
            return None if scheme.error_feedback else scheme
        return scheme.packed(device) if isinstance(scheme, FP16) else None

    def _report(self, flight: _InFlight, outcome: Outcome) -> None:
        """Record the compression error of a tensor without error feedback:
        :meth:`~ErrorFeedback.observe_own` for a scheme keeping its own residual (DGC),
        the payload's error for a compressed all-reduce, :meth:`~ErrorFeedback.observe_sent`
        for the others (their outcome's ``sent``)."""
        scheme, name = flight.scheme, flight.name
        if isinstance(scheme, KeepsResidual):
            residual = scheme.own_residual(outcome.state)
            if residual is not None:
                self.feedback.observe_own(name, residual, outcome.sent, scheme.name,
                                          scheme.residual_name)
                return
        if flight.codec is not None and flight.scatter is not None:
            x_norm, error = payload_distance(flight.codec, flight.scatter, flight.x,
                                             self.comm.size)
            self.feedback.observe_error(name, x_norm, error, 1.0, scheme.name)
            return
        self.feedback.observe_sent(name, flight.x, outcome.sent, scheme.name)

    def _result(self, outcome: Outcome, grad: torch.Tensor, out: torch.Tensor | None,
                scale: float) -> torch.Tensor:
        """The tensor's averaged aggregate in its gradient's shape and dtype, written into
        ``out`` if given."""
        if out is not None:
            return write_scaled(outcome.aggregate, out, scale)
        aggregate = materialize(outcome.aggregate).view(grad.shape)
        if scale != 1.0:
            aggregate = aggregate * scale
        return aggregate.to(grad.dtype)

    # State ---------------------------------------------------------------------------------
    def scheme_state(self, name: str) -> dict[str, torch.Tensor]:
        """The scheme's committed state for one tensor (PowerSGD's ``q``, a rank's
        ``chunk_residual`` in the compressed all-reduce); empty if it has none."""
        return dict(self._scheme_state.get(name, {}))

    def state_dict(self) -> dict[str, Any]:
        """Residuals, scheme state and step counters: everything needed to resume exactly."""
        return {
            "version": STATE_VERSION,
            "scheme": self.scheme.describe(),
            "steps": dict(self._steps),
            "residuals": self.feedback.state_dict(),
            "scheme_state": {name: {k: v.detach().clone() for k, v in st.items()}
                             for name, st in self._scheme_state.items()},
            **({"auto_routes": dict(self.auto_decision.routes)}
               if self.auto_decision is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._inflight:
            raise RuntimeError("cannot load state while exchanges are in flight; call wait()")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"compression state has version {state.get('version')!r}; this "
                             f"hvd_compress reads version {STATE_VERSION}")
        if state["scheme"] != self.scheme.describe():
            raise ValueError(f"compression state was saved with {state['scheme']} but this "
                             f"optimizer uses {self.scheme.describe()}; construct the "
                             "optimizer with the same compression= to resume")
        self._steps = defaultdict(int, state["steps"])
        self.feedback.load_state_dict(state["residuals"])
        self._scheme_state = {name: {k: torch.as_tensor(v).clone() for k, v in st.items()}
                              for name, st in state["scheme_state"].items()}
        routes = state.get("auto_routes")
        if routes is not None and self.auto_decision is not None:
            # Resume on the routes the checkpoint was taken with (measured again, the routes
            # of this run could differ and the next step would not be the one it would have
            # been); tensors the checkpoint does not name keep this run's routes.
            decision = self.auto_decision
            routes = {n: routes.get(n, r) if routes.get(n) in decision.costs[n] else r
                      for n, r in decision.routes.items()}
            self.auto_decision = dataclasses.replace(
                decision, routes=routes,
                predicted=auto_routes.predict(decision.costs, routes, decision.link))
            self._routes.clear()
