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

Buckets and fused rounds (:mod:`hvd_compress.fusion`): a bucket's requests of one round
and kind travel as one collective, started as soon as the bucket is complete.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import AllToAll, Collective, nbytes
from hvd_compress.errors import NonFiniteGradientError
from hvd_compress.feedback import (
    Candidate,
    Commit,
    ErrorFeedback,
    KeepsResidual,
    norms_of,
    payload_distance,
    watch_scatter,
)
from hvd_compress.fusion import assign_buckets, fuse, fused_name, fusion_key, split_result
from hvd_compress.policy import DENSE_SCHEME, Auto, Decision, LinkModel, Policy, routes_for
from hvd_compress.schemes.base import (
    Exchange,
    ExchangeContext,
    LowRank,
    Outcome,
    Scattered,
    Scheme,
    materialize,
    total,
    write_scaled,
)
from hvd_compress.schemes.batched import batches
from hvd_compress.schemes.dense import NoCompression
from hvd_compress.schemes.packed import PackedScheme
from hvd_compress.step_stats import StepStats

STATE_VERSION = 1
DEFAULT_BUCKET_BYTES = 64 << 20
"""64 MiB, Horovod's default fusion threshold (``HOROVOD_FUSION_THRESHOLD``)."""

FLOAT32_MAX = torch.finfo(torch.float32).max
"""The largest finite float32: an aggregate whose norm exceeds it is checked element by
element (:meth:`Pipeline._check_finite`)."""
DEFAULT_REPORT_EVERY = 10
"""Steps between measurements of the compression error of a tensor without error feedback
(``report_every`` of :class:`Pipeline` and of every binding's wrapper)."""



# The pipeline -------------------------------------------------------------------------------
@dataclass
class _InFlight:
    """One tensor's exchange in this step."""

    name: str
    grad: torch.Tensor
    x: torch.Tensor
    scheme: Scheme
    exchange: Exchange | None  # None: deferred to its bucket's batched exchange
    feedback: bool = False  # x is g + e: the residual is committed with the outcome
    ctx: ExchangeContext | None = None
    parts: list[_InFlight] | None = None  # a batched exchange: the members it runs for
    request: Collective | None = None  # yielded by the exchange, not yet started
    outcome: Outcome | None = None
    codec: PackedScheme | None = None  # a compressed all-reduce without error feedback
    scatter: AllToAll | None = None  # its payload, for the compression error
    # Settled with its bucket (Pipeline._settle), kept until the step commits:
    finite: bool | None = None  # its aggregate's finite check; None: not checked yet
    candidate: Candidate | None = None  # its residual update, computed, not installed
    result: torch.Tensor | None = None  # its averaged aggregate, already written

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
    settled: bool = False

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
            (see :mod:`hvd_compress.fusion`). Default 64 MiB, Horovod's default fusion threshold.
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
            off most steps (docs/benchmarks.md has its cost).

    ``settle_early`` (class attribute, default ``True``): each bucket is checked, its
    residual updates computed and its aggregates written as soon as its last round ends
    (:meth:`_settle`); ``False`` does all of it after the last bucket's round, the same
    results bit for bit (a performance switch for comparisons, not an option).
    """

    settle_early = True

    def __init__(self, scheme: Scheme | Auto, comm: Communicator, policy: Policy | None = None,
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
        self.routes = routes_for(scheme, self.policy, comm)
        """Which scheme each tensor travels with (:mod:`hvd_compress.policy`)."""
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
        self._found_bad = False  # a settled bucket held a non-finite aggregate
        self._current = StepStats()
        self.last_step = StepStats()
        self.total = StepStats()

    # Routing and planning ------------------------------------------------------------------
    def route(self, name: str, shape: torch.Size) -> Scheme:
        """The scheme a tensor of this name and shape travels with (cached)."""
        return self.routes.route(name, shape)

    @property
    def auto_decision(self) -> Decision | None:
        """``Compression.auto``'s routes and the measurements they were decided from
        (``None`` for another scheme, or before the first decision)."""
        return self.routes.decision

    def redecide(self, link: LinkModel | None = None,
                 device: torch.device | str = "cpu") -> Decision:
        """Measure again (the link too, unless ``link`` is given) and decide
        ``Compression.auto``'s routes for every tensor it has seen, keeping current routes
        unless another is clearly cheaper. Collectives: every rank calls it at the same
        point, between steps. ``TypeError`` for a pipeline of another scheme."""
        if self._inflight:
            raise RuntimeError("cannot decide routes while exchanges are in flight; call "
                               "wait() first")
        return self.routes.redecide(torch.device(device), link)

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
        if shapes is not None:
            self.routes.planned(dict(zip(names, shapes, strict=True)), torch.device(device))
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
        elif scheme is not DENSE_SCHEME:
            x = x.float()
        self._current.seconds["feedback"] += time.perf_counter() - started
        ctx = ExchangeContext(name, self.comm.rank, self.comm.size, self._steps[name],
                              self.seed)
        state = self._scheme_state.get(name, {})
        if grad.numel() and batches(scheme) and scheme.batches(x, state, ctx):  # type: ignore[attr-defined]
            # Its exchange starts with its bucket's, for all of them at once.
            flight = _InFlight(name, grad, x, scheme, None, feedback, ctx)
            self._inflight[name] = flight
            try:
                self._place(flight)
            except BaseException as exc:
                if self._failure is None:
                    self._failure = exc
                raise
            return
        exchange = scheme.exchange(x, state, ctx)
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

        Each bucket is settled as soon as its last round ends, while later buckets' rounds
        are still on the link (:meth:`_settle`): its aggregates are checked, its residual
        updates computed (installed only when the whole step commits) and its aggregates
        written into ``into``. So after a failed step the tensors of ``into`` of buckets
        settled before any non-finite aggregate was found may hold their aggregates; the
        others keep what they held. Aggregates, residuals and state are those of settling
        the whole step at once, bit for bit.
        """
        flights = list(self._inflight.values())
        into = into or {}
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
            for bucket in self._launched:
                if not bucket.groups and self.settle_early:
                    self._settle(bucket, into)
            while active:
                for bucket in active:
                    self._finish_phase(bucket)
                    if not bucket.groups and self.settle_early:
                        self._settle(bucket, into)
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
            self._found_bad = False
        started = time.perf_counter()
        try:
            self._check_finite(flights)
        except NonFiniteGradientError:
            self._current = StepStats()
            raise
        self._current.seconds["commit"] += time.perf_counter() - started
        return self._commit(flights, into)

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
        assert flight.exchange is not None
        try:
            flight.request = flight.exchange.send(result)
        except StopIteration as done:
            flight.request, flight.outcome = None, done.value
            if flight.parts is not None:
                outcomes = done.value
                if len(outcomes) != len(flight.parts):
                    raise RuntimeError(f"{flight.scheme.name}: a batched exchange returned "
                                       f"{len(outcomes)} outcomes for {len(flight.parts)} "
                                       "tensors") from None
                for part, outcome in zip(flight.parts, outcomes):
                    part.outcome = outcome
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
        self._start_batches(bucket)
        self._start_phase(bucket)

    def _start_batches(self, bucket: _Bucket) -> None:
        """Start the exchanges its members deferred (:mod:`hvd_compress.schemes.batched`):
        one per scheme, dtype and device, in the place of its first member."""
        deferred: dict[tuple[int, torch.dtype, torch.device], list[_InFlight]] = {}
        for flight in bucket.members:
            if flight.exchange is None:
                key = (id(flight.scheme), flight.x.dtype, flight.x.device)
                deferred.setdefault(key, []).append(flight)
        for parts in deferred.values():
            first, scheme = parts[0], parts[0].scheme
            exchange = scheme.exchange_many(  # type: ignore[attr-defined]
                [f.x for f in parts], [self._scheme_state.get(f.name, {}) for f in parts],
                [f.ctx for f in parts])
            name = f"{first.name}+{len(parts) - 1}" if len(parts) > 1 else first.name
            batch = _InFlight(name, first.grad, first.x, scheme, exchange, parts=parts)
            bucket.members.insert(bucket.members.index(first), batch)
            self._advance(batch, None)

    def _start_phase(self, bucket: _Bucket) -> None:
        """Start the collectives of the bucket's current phase: one per fusion key (in the
        order of each key's first member), one per request that is never fused."""
        members: list[list[_InFlight]] = []
        by_key: dict[Any, list[_InFlight]] = {}
        for flight in bucket.members:
            if flight.request is None:
                continue  # exchange finished
            key = fusion_key(flight.request, getattr(self.comm, "gathers_frames", False))
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
        if len(members) == 1 and len(members[0].parts or ()) < 2:
            name, op = f"hvdc.{names[0]}.{requests[0].round}", requests[0]
        else:
            # A batch is named by all its tensors and their sizes, so that ranks that
            # disagree on its content start different names (the fusion module notes).
            name = fused_name(bucket.index, bucket.phase, [
                f.name if f.parts is None else "+".join(f"{p.name}:{p.x.numel()}"
                                                        for p in f.parts)
                for f in members], requests)
            op = requests[0] if len(members) == 1 else fuse(
                requests, self.comm.rank, self.comm.size,
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
        infinity (those its bucket's settling checked are not checked again: see
        :meth:`_nonfinite`). ``local`` names the bad tensors whose input on this rank was
        already non-finite; a bad tensor's input is intact, since nothing is prepared from
        a bucket once a non-finite aggregate was found (:meth:`_settle`)."""
        self._nonfinite([f for f in flights if f.finite is None])
        bad = [f for f in flights if not f.finite]
        if not bad:
            return
        local = [f.name for f in bad if not bool(f.x.isfinite().all())]
        step = max(self._steps[f.name] for f in bad)
        raise NonFiniteGradientError([f.name for f in bad], local, step, self.comm.rank)

    def _nonfinite(self, flights: list[_InFlight]) -> list[_InFlight]:
        """The flights whose aggregate holds a NaN or an infinity; sets each one's
        ``finite``.

        A norm is NaN or infinite whenever one of its terms is, so a finite norm per
        aggregate (or per factor of a :class:`LowRank` one, whose entries are bounded by the
        product of its factors' norms) clears it. Aggregates are mostly views of a few
        buffers (a fused round's result, a batched exchange's flat sums and QR blocks), and a
        view's norm is at most its buffer's: the norms taken are those of the distinct
        buffers (each view's ``_base``), one ``torch._foreach_norm`` and one device-to-host
        transfer for the step. Only a tensor whose bound is not finite (a non-finite element in its
        buffer, or a norm beyond float32's range) is looked at element by element, so the
        tensors found bad are exactly those with a non-finite element.
        """
        if not flights:
            return []
        parts: list[list[torch.Tensor]] = []
        for f in flights:
            assert f.outcome is not None
            value = f.outcome.aggregate
            if isinstance(value, torch.Tensor):
                parts.append([value])
            elif isinstance(value, LowRank):
                parts.append([value.left, value.right])
            else:
                parts.append([total(value)])
        index: dict[int, int] = {}
        bases: list[torch.Tensor] = []
        where: list[list[int]] = []
        for tensors in parts:
            at = []
            for t in tensors:
                base = t if t._base is None else t._base
                i = index.get(id(base))
                if i is None:
                    i = index[id(base)] = len(bases)
                    bases.append(base)
                at.append(i)
            where.append(at)
        norms = norms_of(bases)
        bad = []
        for f, at in zip(flights, where, strict=True):
            bound = norms[at[0]] * norms[at[1]] if len(at) == 2 else norms[at[0]]
            f.finite = bound <= FLOAT32_MAX \
                or bool(materialize(f.outcome.aggregate).isfinite().all())  # type: ignore[union-attr]
            if not f.finite:
                bad.append(f)
        return bad

    def _settle(self, bucket: _Bucket, into: Mapping[str, torch.Tensor]) -> None:
        """Do a bucket's share of the commit as soon as its last round has ended, while
        later buckets' rounds are still on the link: check its aggregates
        (:meth:`_nonfinite`) and, unless this step already holds a non-finite one, compute
        its residual updates (:meth:`~hvd_compress.feedback.ErrorFeedback.prepare`: in
        the pipeline's own ``g + e`` buffers, the stored residuals untouched) and write its
        averaged aggregates into ``into`` (or new tensors). Nothing is installed: residuals,
        scheme state and step counters change in :meth:`_commit`, once every bucket is
        finite. A tensor whose compression error is measured this step from its input
        (no error feedback, :meth:`_reports`) is written at the commit, after its report,
        since its input may be the very gradient written into."""
        if bucket.settled:
            return
        bucket.settled = True
        started = time.perf_counter()
        flights = [f for f in bucket.members if f.parts is None]
        if self._nonfinite(flights):
            self._found_bad = True
        if not self._found_bad:
            feedback = [f for f in flights if f.feedback]
            for f, candidate in zip(feedback, self.feedback.prepare(
                    [self._feedback_commit(f) for f in feedback]), strict=True):
                f.candidate = candidate
            copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            for f in flights:
                if f.feedback or isinstance(f.scheme, NoCompression) \
                        or not self._reports(f.name, f.scheme):
                    f.result = self._write(f, into.get(f.name), copies)
            self._write_copies(copies)
        # Overlapped with the link while another bucket still has rounds in flight.
        overlapped = any(b.groups for b in self._launched)
        self._current.seconds["settle" if overlapped else "commit"] += \
            time.perf_counter() - started

    @property
    def _scale(self) -> float:
        """What every aggregate (a sum over ranks) is multiplied by: the prescale, over the
        number of ranks when averaging."""
        return self.prescale / (self.comm.size if self.average else 1)

    def _feedback_commit(self, flight: _InFlight) -> Commit:
        """The error-feedback commit of a flight that has it (``flight.feedback``)."""
        assert flight.outcome is not None
        sent = flight.outcome.sent if flight.scheme.error_feedback else None
        return Commit(flight.name, flight.x, sent, flight.scheme.name,
                      self.feedback.due(flight.name, self.report_every))

    def _write(self, flight: _InFlight, out: torch.Tensor | None,
               copies: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
        """The flight's averaged aggregate, written into ``out`` if given: a plain tensor of
        ``out``'s dtype and device is queued in ``copies`` (``(outs, aggregates)``) for
        :meth:`_write_copies`, anything else written now (:meth:`_result`)."""
        assert flight.outcome is not None
        value = flight.outcome.aggregate
        if out is not None and isinstance(value, torch.Tensor) and value.dtype == out.dtype \
                and value.device == out.device:
            copies[0].append(out)
            copies[1].append(value.view(out.shape))
            return out
        return self._result(flight.outcome, flight.grad, out, self._scale)

    def _write_copies(self, copies: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        """The queued writes of :meth:`_write`: write_scaled's arithmetic, one call for all
        the tensors."""
        if copies[0]:
            torch._foreach_copy_(copies[0], copies[1])
            if self._scale != 1.0:
                torch._foreach_mul_(copies[0], self._scale)


    def _commit(self, flights: list[_InFlight],
                into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep the step: install every residual update (those :meth:`_settle` computed,
        and the rest computed now), scheme state and step counter, report, write the
        aggregates not written yet, count the step's statistics."""
        started = time.perf_counter()
        results: dict[str, torch.Tensor] = {}
        stats = self._current
        commits = [self._feedback_commit(f) for f in flights
                   if f.feedback and f.candidate is None]
        fresh = {c.name: c for c in self.feedback.prepare(commits)}
        copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (out, aggregate)
        for flight in flights:
            outcome = flight.outcome
            assert outcome is not None
            name, scheme = flight.name, flight.scheme
            if not flight.feedback and not isinstance(scheme, NoCompression) \
                    and self._reports(name, scheme):
                reported = time.perf_counter()
                self._report(flight, outcome)  # before _write may write into the gradient
                stats.seconds["report"] += time.perf_counter() - reported
            if outcome.state:
                self._scheme_state[name] = outcome.state
            self._steps[name] += 1
            results[name] = flight.result if flight.result is not None \
                else self._write(flight, into.get(name), copies)
            stats.payload_bytes += outcome.payload_bytes
            stats.dense_bytes += 4 * flight.grad.numel()
            if isinstance(outcome.sent, Scattered):
                stats.sparse_entries += flight.grad.numel()
                stats.sent_entries += outcome.sent.indices.numel()
            if isinstance(scheme, NoCompression):
                stats.dense_tensors += 1
            else:
                stats.compressed_tensors += 1
        self.feedback.install([f.candidate or fresh[f.name] for f in flights if f.feedback])
        self._write_copies(copies)
        stats.seconds["commit"] += time.perf_counter() - started
        self.total.add(stats)
        self.last_step, self._current = stats, StepStats()
        if flights:
            self.routes.after_step(flights[0].grad.device, stats.seconds)
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
        ``device`` (:meth:`~hvd_compress.schemes.base.Scheme.packed`: the scheme itself, or
        float16's payload on the CPU); else ``None``."""
        return None if scheme.error_feedback else scheme.packed(device)

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
            **self.routes.state_dict(),
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
        self.routes.load_state_dict(state)
