"""Routing: which scheme each tensor travels with.

The pipeline (:mod:`hvd_compress.pipeline`) asks its :class:`Routes` for a tensor's scheme.
With one scheme (:class:`Routes`) the :class:`Policy` decides: the scheme where every rule
lets the tensor through, a plain all-reduce elsewhere. With ``Compression.auto``
(:class:`Auto`, routed by :class:`AutoRoutes`) a cost model measured on the job's own links
and devices chooses per tensor between dense (float32 all-reduce), float16 and the given
scheme, among the routes the policy allows.

Compression trades bytes for compute and rounds: on a slow link a low-rank or quantised
exchange wins, on a fast one the encoding, an extra round and the slowest rank's products
can make a step slower than sending dense. See docs/benchmarks.md for measurements.

The cost model
--------------
Its arithmetic (byte counts per collective, the sum per plan) lives in
:mod:`hvd_compress.cost_model`, shared with the scale model ``python -m hvd_compress.bench
model`` (docs/scale-model.md). For each tensor and each candidate route, the predicted
exchange time is::

    t(route) = compute(route) + send_bytes(route) * seconds_per_byte

* ``compute``: this rank's time in the route's own code (encode, decode, products), measured
  at start-up by running the route's exchange on a tensor of the same shape with the
  collectives answered locally (:func:`measure_route`: every rank is taken to have sent what
  this one sent). Measured on the device and under the load the job really runs with.
* ``send_bytes``: the bytes this rank puts on its link for the route's requests, counted
  from those same requests: ``2 (p - 1) / p`` of an all-reduce (a ring), ``(p - 1) / p`` of
  an all-to-all, ``p - 1`` times an all-gather's or a sparse sum's contribution (every
  other rank's copy passes through; a parameter server sends fewer, so this is an upper
  bound for it).
* ``seconds_per_byte`` and ``latency``: from a probe (:func:`probe_link`), all-reduces of
  growing size timed end to end, so they include Horovod's negotiation and cycle time, the
  reduction's own arithmetic and the other ranks' load. ``latency`` is the median of small
  all-reduces; ``seconds_per_byte`` the slope up to the largest one, which grows until it
  takes ``probe_seconds`` (so a slow link is probed with little data, a fast one with
  up to 16 MiB).

A plan's predicted step exchange is the sum of its tensors' costs plus ``latency`` per
collective it starts: the pipeline fuses a bucket's requests of one round and kind into one
collective, so that is one per distinct (round, kind) over the plan's routes (PowerSGD's
``P`` and a dense tensor's all-reduce share one; fp16's all-to-all on a CPU is another), and
one per tensor and round for requests that never fuse (sparse sums). Per-tensor choices
cannot see that shared cost, so the plans compared are: every tensor on its cheapest route;
the same without the fp16 route; without the scheme; and everything dense. The fastest
predicted wins. A route the :class:`Policy` excludes for a tensor (a
bias, a tiny tensor, a shape the scheme cannot encode) is never chosen for it.

Agreement and re-decision
-------------------------
Every rank measures, the measurements are averaged over ranks by an all-reduce, and rank 0's
decisions are what every rank applies (distributed by a second all-reduce), so routes are
identical on every rank even where floating-point rounding could differ.

Every ``recheck_every`` steps the pipeline compares the exchange time it measured (its own
``scheme``, ``fuse`` and ``wait`` seconds, averaged over ranks) with the prediction. When the
prediction is off by more than a factor ``1 + tolerance`` and the transfer is a sizeable
part of it, the link model is corrected from the measurement (``seconds_per_byte`` refitted
to the measured time) and the routes are decided again; the change is logged.

Error feedback follows the route: a tensor whose route changes from an error-feedback scheme
to a dense one sends its residual with its next gradient and keeps none.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, SparseSum, nbytes
from hvd_compress.cost_model import (
    LinkModel,
    RouteCost,
    collectives,
    kind,
    predict,
    send_bytes,
)
from hvd_compress.schemes.base import ExchangeContext, Outcome, Scheme, subtract, write_scaled
from hvd_compress.schemes.dense import FP16, NoCompression


@dataclass(frozen=True)
class Policy:
    """Per-tensor routing: a tensor is compressed only if every rule lets it through.

    Args:
        min_numel: tensors with fewer elements go dense. Their bytes are negligible and
            Horovod fuses them into one all-reduce, while encoding them would cost a kernel
            launch each and, for bucketed codecs, a whole bucket's scale.
        compress_1d: 1-D tensors (biases, normalisation weights) go dense unless this is
            set: they are small, and their errors shift every activation of a layer.
        min_compression_rate: tensors the scheme would shrink by less go dense. ``None``
            uses the scheme's own threshold (PowerSGD's ``min_compression_rate``; 1 for the
            others, whose rate does not depend on the shape).
    """

    min_numel: int = 1024
    compress_1d: bool = False
    min_compression_rate: float | None = None

    def compresses(self, scheme: Scheme, shape: torch.Size) -> bool:
        if shape.numel() < max(self.min_numel, 1) or not scheme.applies_to(shape):
            return False
        if len(shape) <= 1 and not self.compress_1d:
            return False
        threshold = self.min_compression_rate
        if threshold is None:
            threshold = scheme.min_compression_rate
        return scheme.compression_rate(shape) >= threshold


log = logging.getLogger("hvd_compress.auto")

Run = Callable[[str, Collective], Any]
"""Start a collective by name and wait for its result (the pipeline's communicator)."""

DENSE, HALF, SCHEME = "dense", "fp16", "scheme"
ROUTES = (DENSE, HALF, SCHEME)
_PROBE_TINY = 256  # float32 elements: 1 KiB, for the latency
_PROBE_FIRST = 1 << 16  # 256 KiB, the first size for the bandwidth
_PROBE_LARGEST = 1 << 22  # 16 MiB


@dataclass
class Decision:
    """Routes for a set of tensors, and the numbers they were decided from."""

    link: LinkModel
    costs: dict[str, dict[str, RouteCost]]
    routes: dict[str, str]
    predicted: float
    dense_predicted: float
    shapes: dict[str, torch.Size] = field(default_factory=dict)

    def table(self) -> str:
        """The start-up log: one line per tensor with its route and the costs compared."""
        lines = [f"link: latency {self.link.latency * 1e3:.2f} ms, "
                 f"{self.link.bandwidth * 8 / 1e6:.1f} Mbit/s per rank; predicted exchange "
                 f"{self.predicted * 1e3:.1f} ms per step (all dense: "
                 f"{self.dense_predicted * 1e3:.1f} ms)",
                 f"{'tensor':40} {'shape':>16} {'route':>7}  "
                 + "  ".join(f"{r + ' ms':>10}" for r in ROUTES)]
        for name in sorted(self.routes):
            costs = self.costs[name]
            cells = [f"{costs[r].seconds(self.link) * 1e3:10.2f}" if r in costs else
                     f"{'-':>10}" for r in ROUTES]
            shape = "x".join(map(str, self.shapes.get(name, ()))) or "-"
            lines.append(f"{name[:40]:40} {shape:>16} {self.routes[name]:>7}  "
                         + "  ".join(cells))
        return "\n".join(lines)


class Auto:
    """Send each tensor dense, as float16 or with ``scheme``, whichever the cost model
    (module docstring) predicts is fastest on the job's own links and devices.

    Args:
        scheme: the compression to use where it pays. ``Compression.auto`` also takes a
            :meth:`~hvd_compress.Compression.parse` string, and defaults to PowerSGD rank 4.
        fp16: also consider float16 (default ``True``).
        recheck_every: compare the measured exchange time with the prediction every this
            many steps, and decide again when they disagree (default 50; 0: never).
        tolerance: how far (as a factor ``1 + tolerance``) measurement and prediction may
            differ before the model is corrected (default 0.5).
        probe_seconds: the bandwidth probe doubles its all-reduce until one takes this long
            (default 0.05 s) or reaches 16 MiB.

    It is passed as ``compression=`` like a scheme, but it is not one: it never exchanges a
    tensor itself, the pipeline's :class:`AutoRoutes` sends each tensor with the route
    chosen for it. The pipeline measures and decides when
    the tensors are planned (the optimizer's construction), or after the first step, which
    then travels dense, when no plan gave their shapes. The decision is logged at INFO by
    rank 0 on the logger ``hvd_compress.auto`` and kept by the pipeline
    (:attr:`hvd_compress.Pipeline.auto_decision`). The object itself holds no state, so one
    may serve several pipelines.
    """

    name = "auto"

    def __init__(self, scheme: Scheme, fp16: bool = True,
                 recheck_every: int = 50, tolerance: float = 0.5,
                 probe_seconds: float = 0.05) -> None:
        if isinstance(scheme, str):
            raise TypeError(f"auto: scheme must be a scheme object; for a spec string use "
                            f"Compression.auto({scheme!r}) or Compression.parse('auto:"
                            f"{scheme}')")
        if not isinstance(scheme, Scheme) or isinstance(scheme, Auto):
            raise TypeError(f"auto: scheme must be a compression scheme other than auto, got "
                            f"{scheme!r}")
        if recheck_every < 0:
            raise ValueError(f"auto: recheck_every must be >= 0, got {recheck_every}")
        if tolerance <= 0:
            raise ValueError(f"auto: tolerance must be > 0, got {tolerance}")
        if probe_seconds <= 0:
            raise ValueError(f"auto: probe_seconds must be > 0, got {probe_seconds}")
        self.scheme = scheme
        self.fp16 = fp16
        self.recheck_every = recheck_every
        self.tolerance = tolerance
        self.probe_seconds = probe_seconds
        self.error_feedback = scheme.error_feedback
        self.min_compression_rate = scheme.min_compression_rate
        self._candidates: dict[str, Scheme] = {DENSE: NoCompression(), SCHEME: scheme}
        if fp16:
            self._candidates[HALF] = FP16()

    def candidates(self) -> dict[str, Scheme]:
        """The routes considered, by name: ``dense``, ``fp16`` (unless disabled), ``scheme``."""
        return dict(self._candidates)

    def check_optimizer(self, optimizer: Any) -> None:
        """The wrapped scheme's check (DGC refuses an optimizer with momentum)."""
        self.scheme.check_optimizer(optimizer)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "scheme": self.scheme.describe(), "fp16": self.fp16}

    def __repr__(self) -> str:
        return f"Compression.auto({self.scheme!r}, fp16={self.fp16})"

    # Horovod's Compressor interface: refused with the schemes' error, which says what to use.
    compress = Scheme.compress
    decompress = Scheme.decompress

    # Deciding ---------------------------------------------------------------------------
    def decide(self, shapes: Mapping[str, torch.Size], allowed: Callable[[torch.Size], bool],
               run: Run, rank: int, size: int, device: torch.device,
               link: LinkModel | None = None, current: Decision | None = None,
               costs: Mapping[str, dict[str, RouteCost]] | None = None) -> Decision:
        """Measure (the link unless ``link`` is given, and every route's compute for every
        shape unless ``costs``, already agreed by every rank, are given), agree with the
        other ranks and choose routes. Every rank must call it with the same ``shapes``, in
        the same order relative to its other collectives.

        With a ``current`` decision, a tensor leaves its route only for one predicted at
        least ``HYSTERESIS`` cheaper, so measurement noise does not flip routes back and
        forth."""
        names = sorted(shapes)
        candidates = self.candidates()
        if size == 1:  # nothing travels: every route is the identity
            return Decision(LinkModel(0.0, 0.0), {n: {} for n in names},
                            {n: DENSE for n in names}, 0.0, 0.0, dict(shapes))
        if link is None:
            link = probe_link(run, size, device, self.probe_seconds)
        if costs is None:
            measured: dict[str, dict[str, RouteCost]] = {}
            for name in names:
                shape = shapes[name]
                measured[name] = {}
                for route, scheme in candidates.items():
                    if route == SCHEME and not allowed(shape):
                        continue
                    measured[name][route] = measure_route(scheme, shape, rank, size, device)
            costs = _agree_costs(measured, names, run, size, device)
        plans = cheapest_plans(costs, link, current)
        dense_predicted = predict(costs, plans[-1], link)
        routes = min(plans, key=lambda plan: predict(costs, plan, link))
        routes = _from_rank0(routes, names, run, rank, device)
        decision = Decision(link, costs, routes, predict(costs, routes, link), dense_predicted,
                            dict(shapes))
        if rank == 0:
            log.info("Compression.auto(%r):\n%s", self.scheme, decision.table())
        return decision

    def revise(self, current: Decision, measured: float, shapes: Mapping[str, torch.Size],
               allowed: Callable[[torch.Size], bool], run: Run, rank: int, size: int,
               device: torch.device) -> Decision | None:
        """Compare ``measured`` (seconds of exchange per step, already agreed by every rank)
        with ``current``'s prediction; return a new decision when the model was wrong, else
        ``None``. The link model is refitted to the measurement: the part of ``measured``
        the routes' compute and rounds do not explain is taken as their transfer."""
        predicted = current.predicted
        if predicted <= 0 or 1 / (1 + self.tolerance) <= measured / predicted <= 1 + self.tolerance:
            return None
        sent = sum(current.costs[n][r].send_bytes for n, r in current.routes.items())
        transfer = sent * current.link.seconds_per_byte
        if transfer < 0.2 * predicted or sent <= 0:
            return None  # the transfer is too small a part to refit the link from
        compute = sum(current.costs[n][r].compute for n, r in current.routes.items())
        unexplained = measured - compute - current.link.latency * collectives(
            current.costs, current.routes)
        per_byte = max(unexplained, 0.1 * transfer) / sent
        link = LinkModel(current.link.latency, per_byte)
        if rank == 0:
            log.info("Compression.auto: measured %.1f ms per step against %.1f ms predicted; "
                     "link refitted to %.1f Mbit/s per rank", measured * 1e3, predicted * 1e3,
                     link.bandwidth * 8 / 1e6)
        before = dict(current.routes)
        # What each route computes and sends depends on the shapes only, and was agreed
        # by every rank: a changed link is a new price for the same routes.
        same = dict(shapes) == current.shapes and set(current.costs) == set(shapes)
        decision = self.decide(shapes, allowed, run, rank, size, device, link=link,
                               current=current, costs=current.costs if same else None)
        changed = sorted(n for n in decision.routes if before.get(n) != decision.routes[n])
        if rank == 0 and changed:
            log.info("Compression.auto: %d route(s) changed: %s", len(changed),
                     ", ".join(f"{n} {before.get(n)}->{decision.routes[n]}" for n in changed))
        return decision


HYSTERESIS = 0.2
"""A route changes only for one predicted at least this much (a fraction) cheaper."""


def cheapest_plans(costs: Mapping[str, Mapping[str, RouteCost]], link: LinkModel,
                   current: Decision | None = None) -> list[dict[str, str]]:
    """The plans :meth:`Auto.decide` compares (module docstring): every tensor on its
    cheapest route; the same without fp16; without the scheme; all dense (last). With a
    ``current`` decision a tensor keeps its route unless another is :data:`HYSTERESIS`
    cheaper."""
    return [{name: _cheapest(costs[name], link, without,
                             current.routes.get(name) if current is not None else None)
             for name in sorted(costs)} for without in ((), (HALF,), (SCHEME,), (HALF, SCHEME))]


def _cheapest(costs: Mapping[str, RouteCost], link: LinkModel, without: Sequence[str],
              current: str | None) -> str:
    """The cheapest route not in ``without`` (dense is always allowed); ``current`` is kept
    unless another is :data:`HYSTERESIS` cheaper."""
    allowed = {r: c for r, c in costs.items() if r == DENSE or r not in without}
    best = min(allowed, key=lambda r: allowed[r].seconds(link))
    if current in allowed and allowed[best].seconds(link) > \
            (1 - HYSTERESIS) * allowed[current].seconds(link):
        return current
    return best


# Measuring ------------------------------------------------------------------------------
def echo(op: Collective, rank: int, size: int) -> Any:
    """The result ``op`` would have if every rank had sent what this one sent."""
    if isinstance(op, AllReduce):
        return op.tensor * size
    if isinstance(op, AllGather):
        if op.sizes is None:
            return [op.tensor.repeat(size)]
        flat = op.tensor.reshape(-1)
        return [flat.clone() if r == rank else flat.new_zeros(op.sizes[r]) for r in range(size)]
    if isinstance(op, AllToAll):
        mine = torch.split(op.tensor.reshape(-1), list(op.splits))[rank]
        return [mine.clone() for _ in range(size)]
    assert isinstance(op, SparseSum)
    out = torch.zeros(op.numel, dtype=torch.float32, device=op.values.device)
    return out.index_add_(0, op.indices.to(torch.long), op.values.float() * size)


def measure_route(scheme: Scheme, shape: torch.Size, rank: int, size: int,
                  device: torch.device, repeats: int = 2, commit: bool = False) -> RouteCost:
    """Run ``scheme``'s exchange on a random tensor of ``shape`` with :func:`echo` answering
    its requests; the fastest of ``repeats`` runs (the first warms caches and allocators).
    The exchange runs at a late step, so warm-up phases (PowerSGD's ``start_iter``) are
    skipped and the steady state is what is measured.

    ``commit``: also time what the pipeline's commit does with the outcome, which differs
    by scheme: the averaged aggregate written into a tensor of ``shape`` (a copy for a
    dense one, a product for PowerSGD's factors, a decode for packed payloads), and, for a
    scheme with error feedback, its own contribution taken off the residual. The scale
    model counts these as the route's codec (``bench model``); ``Compression.auto``
    compares the exchanges alone."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234 + rank)
    x = torch.randn(shape, generator=gen, device=device)
    best = float("inf")
    sent, kinds, payloads = 0.0, [], []
    state: Mapping[str, torch.Tensor] = {}
    for _ in range(repeats):
        ctx = ExchangeContext("hvdc.auto.measure", rank, size, step=1 << 30)
        exchange = scheme.exchange(x, state, ctx)
        sent, kinds, payloads, spent = 0.0, [], [], 0.0
        result: Any = None
        while True:
            started = time.perf_counter()
            try:
                op = exchange.send(result)
            except StopIteration as done:
                spent += time.perf_counter() - started
                state = done.value.state or state
                if commit:
                    spent += _commit_seconds(scheme, done.value, x, size)
                break
            spent += time.perf_counter() - started
            sent += send_bytes(op, size)
            kinds.append(kind(op))
            payloads.append(float(nbytes(op)))
            result = echo(op, rank, size)
        best = min(best, spent)
    return RouteCost(best, sent, tuple(kinds), tuple(payloads))


def _commit_seconds(scheme: Scheme, outcome: Outcome, x: torch.Tensor, size: int) -> float:
    """Seconds of the pipeline's scheme-dependent commit work on one outcome
    (:func:`measure_route`'s ``commit``), into buffers written beforehand, as the
    pipeline's gradients and residuals are (fresh memory would add its page faults)."""
    out = torch.zeros_like(x)
    residual = x.clone() if scheme.error_feedback and outcome.sent is not None else None
    started = time.perf_counter()
    write_scaled(outcome.aggregate, out, 1.0 / size)
    if residual is not None:
        subtract(residual, outcome.sent)
    return time.perf_counter() - started


def probe_link(run: Run, size: int, device: torch.device, probe_seconds: float) -> LinkModel:
    """Time all-reduces of growing size (module docstring); agreed by every rank."""
    def timed(elements: int, tag: str) -> float:
        tensor = torch.ones(elements, dtype=torch.float32, device=device)
        started = time.perf_counter()
        run(f"hvdc.auto.probe.{tag}", AllReduce("probe", tensor))
        return time.perf_counter() - started

    tiny = [timed(_PROBE_TINY, f"tiny{i}") for i in range(5)]
    latency = statistics.median(tiny[1:])
    elements, seconds = _PROBE_FIRST, 0.0
    while True:
        seconds = timed(elements, f"bw{elements}")
        # Every rank must stop at the same size: the ranks' mean time decides.
        total = run(f"hvdc.auto.probe.bw{elements}.agree", AllReduce("probe", torch.tensor(
            [seconds], dtype=torch.float64, device=device)))
        if float(total.cpu()[0]) / size >= probe_seconds or elements >= _PROBE_LARGEST:
            break
        elements *= 2
    sent = 2 * (size - 1) / size * 4 * elements
    per_byte = max(seconds - latency, 1e-9) / sent
    agreed = run("hvdc.auto.probe.agree", AllReduce(
        "probe", torch.tensor([latency, per_byte], dtype=torch.float64, device=device)))
    latency, per_byte = (float(v) / size for v in agreed.cpu())
    return LinkModel(latency, per_byte)


def _agree_costs(measured: Mapping[str, Mapping[str, RouteCost]], names: Sequence[str],
                 run: Run, size: int, device: torch.device) -> dict[str, dict[str, RouteCost]]:
    """Every rank's compute times averaged (bytes and rounds follow from the shape and are
    the same on every rank)."""
    keys = [(n, r) for n in names for r in ROUTES if r in measured[n]]
    local = torch.tensor([measured[n][r].compute for n, r in keys] or [0.0],
                         dtype=torch.float64, device=device)
    agreed = run("hvdc.auto.measure.agree", AllReduce("measure", local)).cpu().tolist()
    costs: dict[str, dict[str, RouteCost]] = {n: {} for n in names}
    for (name, route), compute in zip(keys, agreed, strict=False):
        cost = measured[name][route]
        costs[name][route] = dataclasses.replace(cost, compute=compute / size)
    return costs


def _from_rank0(routes: Mapping[str, str], names: Sequence[str], run: Run, rank: int,
                device: torch.device) -> dict[str, str]:
    """Rank 0's routes on every rank: its route indices summed with zeros from the others."""
    mine = [float(ROUTES.index(routes[n])) if rank == 0 else 0.0 for n in names]
    agreed = run("hvdc.auto.routes", AllReduce("routes", torch.tensor(
        mine or [0.0], dtype=torch.float64, device=device))).cpu().tolist()
    return {n: ROUTES[round(v)] for n, v in zip(names, agreed, strict=False)}


# Routes: what the pipeline asks ---------------------------------------------------------
DENSE_SCHEME = NoCompression()
"""The scheme of a tensor sent dense: a plain all-reduce."""

DEFAULT_BUCKET_MB = 64.0
"""An optimizer's bucket size (MiB of float32 gradients) when neither the caller nor the
scheme names one: Horovod's fusion threshold."""


def default_bucket_mb(compression: object) -> float:
    """The bucket size an optimizer uses when its ``bucket_mb`` is left at its default: the
    scheme's ``fusion_mb`` if it names one, else :data:`DEFAULT_BUCKET_MB`.

    A scheme whose exchange is two dependent rounds of sizeable payloads (1-bit's
    compressed all-reduce: an all-to-all, then an all-gather) prefers smaller buckets, so
    that the first buckets' rounds travel while backward still runs instead of all after
    it (docs/benchmarks.md, "Across models and launchers")."""
    preferred = getattr(compression, "fusion_mb", None)
    return float(preferred) if preferred else DEFAULT_BUCKET_MB


class Routes:
    """The scheme each tensor of a pipeline travels with: ``scheme`` where ``policy``
    compresses the tensor, :data:`DENSE_SCHEME` elsewhere (cached per name and shape).

    The pipeline calls :meth:`planned` when the tensors are planned, :meth:`after_step` after
    each good step, and keeps :meth:`state_dict` in its own; here they do nothing.
    """

    decision: Decision | None = None
    """The routes decided by measurement (``Compression.auto`` only)."""

    def __init__(self, scheme: Scheme, policy: Policy, comm: Communicator) -> None:
        self.scheme = scheme
        self.policy = policy
        self.comm = comm
        self._cache: dict[tuple[str, torch.Size], Scheme] = {}

    def route(self, name: str, shape: torch.Size) -> Scheme:
        """The scheme a tensor of this name and shape travels with."""
        key = (name, shape)
        scheme = self._cache.get(key)
        if scheme is None:
            scheme = self._cache[key] = self._choose(name, shape)
        return scheme

    def _choose(self, name: str, shape: torch.Size) -> Scheme:
        del name
        return self.scheme if self.policy.compresses(self.scheme, shape) else DENSE_SCHEME

    def planned(self, shapes: Mapping[str, torch.Size], device: torch.device) -> None:
        """The tensors of a plan, with their shapes (every rank, at the same point)."""

    def after_step(self, device: torch.device, seconds: Mapping[str, float]) -> None:
        """A step ended well; ``seconds`` is its :class:`~hvd_compress.pipeline.StepStats`
        time by part (every rank, at the same point)."""

    def redecide(self, device: torch.device, link: LinkModel | None = None) -> Decision:
        """Measure and decide again (``Compression.auto`` only: ``TypeError`` here)."""
        raise TypeError(f"redecide() needs Compression.auto, this pipeline uses "
                        f"{self.scheme!r}")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the routing (nothing for a fixed scheme)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` kept."""
        del state


class AutoRoutes(Routes):
    """``Compression.auto``'s routes for one pipeline: dense until decided, then the route
    of the :class:`Decision` (measured when the tensors are planned with their shapes, or
    after the first step that carries a tensor), checked against the measured exchange
    time every ``recheck_every`` steps (:meth:`Auto.revise`)."""

    def __init__(self, auto: Auto, policy: Policy, comm: Communicator) -> None:
        super().__init__(auto.scheme, policy, comm)
        self.auto = auto
        self.decision = None
        self._shapes: dict[str, torch.Size] = {}  # every tensor routed so far
        self._window: list[float] = []  # measured exchange seconds since the decision

    def _choose(self, name: str, shape: torch.Size) -> Scheme:
        self._shapes[name] = shape
        decision = self.decision
        if decision is None or decision.shapes.get(name) != shape:
            return DENSE_SCHEME
        route = decision.routes[name]
        return DENSE_SCHEME if route == DENSE else self.auto.candidates()[route]

    def _allowed(self, shape: torch.Size) -> bool:
        return self.policy.compresses(self.scheme, shape)

    def _run(self, name: str, op: Collective) -> Any:
        return self.comm.wait(self.comm.start(name, op))

    def _decide(self, shapes: Mapping[str, torch.Size], device: torch.device,
                link: LinkModel | None = None, current: Decision | None = None) -> Decision:
        self.decision = self.auto.decide(shapes, self._allowed, self._run, self.comm.rank,
                                         self.comm.size, device, link=link, current=current)
        self._shapes.update(shapes)
        self._window.clear()
        self._cache.clear()
        return self.decision

    def planned(self, shapes: Mapping[str, torch.Size], device: torch.device) -> None:
        self._decide(shapes, device)

    def redecide(self, device: torch.device, link: LinkModel | None = None) -> Decision:
        """Measure again (the link too, unless ``link`` is given) and decide the routes of
        every tensor seen so far, keeping current routes unless another is clearly
        cheaper."""
        return self._decide(dict(self._shapes), device, link, self.decision)

    def after_step(self, device: torch.device, seconds: Mapping[str, float]) -> None:
        """Decide routes for tensors first seen this step; every ``recheck_every`` steps,
        compare the measured exchange time with the prediction (:meth:`Auto.revise`)."""
        decision = self.decision
        if decision is None or any(decision.shapes.get(n) != s for n, s in self._shapes.items()):
            self._decide(dict(self._shapes), device,
                         decision.link if decision is not None else None, decision)
            return
        self._window.append(sum(spent for part, spent in seconds.items()
                                if part in ("scheme", "fuse") or part.startswith("wait")))
        if not self.auto.recheck_every or len(self._window) < self.auto.recheck_every:
            return
        local = torch.tensor([sum(self._window) / len(self._window)], dtype=torch.float64,
                             device=device)
        self._window.clear()
        agreed = self._run("hvdc.auto.recheck", AllReduce("recheck", local))
        measured = float(agreed.cpu()[0]) / self.comm.size
        revised = self.auto.revise(decision, measured, dict(self._shapes), self._allowed,
                                   self._run, self.comm.rank, self.comm.size, device)
        if revised is not None:
            self.decision = revised
            self._cache.clear()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.decision is None else {"auto_routes": dict(self.decision.routes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume on the routes the checkpoint was taken with (measured again, the routes of
        this run could differ and the next step would not be the one it would have been);
        tensors the checkpoint does not name keep this run's routes."""
        routes = state.get("auto_routes")
        decision = self.decision
        if routes is None or decision is None:
            return
        routes = {n: routes.get(n, r) if routes.get(n) in decision.costs[n] else r
                  for n, r in decision.routes.items()}
        self.decision = dataclasses.replace(decision, routes=routes,
                                            predicted=predict(decision.costs, routes,
                                                              decision.link))
        self._cache.clear()


def routes_for(compression: Scheme | Auto, policy: Policy, comm: Communicator) -> Routes:
    """The routing of a pipeline using ``compression`` (a scheme or ``Compression.auto``)."""
    if isinstance(compression, Auto):
        return AutoRoutes(compression, policy, comm)
    return Routes(compression, policy, comm)
