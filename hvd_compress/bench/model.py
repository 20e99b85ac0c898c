"""The scale model: a job's predicted step time from :mod:`hvd_compress.cost_model`.

``python -m hvd_compress.bench model`` predicts the step time of data-parallel training on
``hosts`` hosts of ``per_host`` ranks for a model (a named one, a parameter count, or a saved
per-tensor plan), a scheme, a flat or two-level exchange, a route for sparse rounds
(all-gather or parameter server, with ``shards``), and the cluster's links. Docs, the check
against the emulated cluster and the table for 8-1024 GPUs: docs/scale-model.md.

The model, per step (every term from :mod:`hvd_compress.cost_model`)::

    step = compute + passes + sum over tensors of codec + sum over collectives of
           (cycle + hops * latency + transfer) + server_round_s per server round
           - server_overlap (ranks sharing cores)

* ``compute``: forward, backward and update, given (``Cluster.compute_s``).
* ``codec``: each tensor's route measured here by :func:`hvd_compress.policy.measure_route`
  (the measurement ``Compression.auto`` takes at start-up, plus the route's commit: the
  aggregate written back and, with error feedback, the sent part taken off the residual,
  a product for PowerSGD, a copy for a dense tensor) at 2 and 4 ranks and extrapolated,
  ``a + b p``; times ``Cluster.codec_scale`` (the CPU contention of ranks sharing cores),
  or ``4 n / codec_bytes_per_s`` when a codec throughput is given.
* ``passes``: the pipeline's own passes over the gradients, ``4 n / copy_bytes_per_s``
  each, times ``codec_scale``: error feedback's ``g + e`` over every tensor the scheme
  compresses; with a given codec throughput also the write of every result and the
  residual's subtraction (two passes more), which a measured codec holds.
* ``transfer``: bytes on the busiest link over its rate: a host's link carries the ring's
  or the server's byte count (:func:`host_bytes`); ``8 (1 + header_share) / rate_bits +
  cpu_s_per_byte`` seconds per byte, the second term the hosts' CPU per byte moved through
  their network stack (0 by default; with ``overlap`` it runs while the link sends).
  All-to-all and all-gather rounds take ``gather_factor`` times as long; a dense sum costs
  ``reduce_s_per_byte`` more. These three are fitted for the emulated cluster (:func:`fit`,
  one ``bench cluster`` row each); on a real cluster measure them or leave them at 0/1.
* ``cycle``: a fixed cost per round and kind of collective (Horovod's negotiation cycle:
  the requests of one round and kind are ready together and start in one cycle, fused or
  not, so a round's further buckets and its unfused sparse all-gathers add their hops only;
  :func:`hvd_compress.cost_model.step_cycles`; a server round waits for no cycle, it costs
  ``Cluster.server_round_s``), ``hops``: see
  :func:`hvd_compress.cost_model.hops`.

Two-level (``hierarchy="host"``), the route :func:`hvd_compress.hierarchy.two_level_pipeline`
takes for the scheme (:func:`two_level_split`), with ``W`` hosts of ``L`` ranks:

* ``rounds`` (a scheme with ``linear_rounds``: PowerSGD): the flat algorithm (codec as
  flat, over ``W L`` ranks), each all-reduce of ``b`` bytes (the factors, and the tensors
  the policy sends dense) done in two levels: an in-host reduce-scatter and all-gather,
  ``2 (L - 1) / L * b`` bytes per rank at the in-host rate plus a cycle (none through
  shared memory) and ``L - 1`` ``intra_latency_s`` hops each, and a cross-host all-reduce
  of this local rank's ``b / L`` among ``W`` hosts, the ``L`` local ranks sharing the host
  link: ``2 (W - 1) / W * b`` on it, ``2 (W - 1)`` hops.
* ``slices`` (a ``sliceable`` scheme): ranks of a host reduce-scatter the dense gradient
  over their own link (``2 (L - 1) / L * 4 n`` bytes per rank at the in-host rate), each
  compresses its ``1 / L`` slice (rows of a matrix) and exchanges it with its peers on the
  other hosts, sharing the host's link, then the host all-gathers.
* ``tensors`` (any other scheme, and PowerSGD run with ``split``, its route before
  ``linear_rounds``): the same dense sum inside the host, each tensor coded whole; modelled
  as one coder per host (the host link carries each tensor's payload once).

The in-host rate: ``intra_bits``, or through shared memory (``Cluster.intra_shm``, what
two-level uses on x86-64 hosts) :data:`SHM_PASSES` memory passes per byte at the pipeline's
pass throughput, times ``codec_scale``: CPU work on the cores that compute.

Ranks sharing cores (``Cluster.cores``, the emulated cluster: ``W L`` ranks on one
machine's cores, ``contention`` ranks per core). Every term above is on the step's path,
one after the other, as on a cluster where each rank has its own processor: a collective
ends on every rank at once, and a rank that waits for it leaves its processor idle. A server
round is not a collective: each worker pushes when its own backward ends, while the others
still compute, and the pulls end one after another, so the workers served first go on
computing while the last still wait (measured: docs/results/model/check-overlap-54eca5a).
On shared cores that computing is done while the link sends, and the step is shorter. The
model takes off the server rounds' transfer, at most
the ranks' CPU seconds (``compute``, ``passes``, ``codec`` without the server's summing,
and the in-host stage through shared memory) times ``1 - 1 / contention``: the part of a
rank's CPU time that, on shared cores, is the other ranks' turn (``server_overlap``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from hvd_compress import Compression
from hvd_compress.bench.report import Column, field, markdown_table, optional_field
from hvd_compress.comm.two_level import HOST_ROUND
from hvd_compress.cost_model import (
    ALLREDUCE,
    ALLTOALL,
    KINDS,
    SERVER,
    SPARSE,
    LinkModel,
    RouteCost,
    hops,
    link_bytes,
    predict,
    server_bytes,
    step_collectives,
    step_cycles,
)
from hvd_compress.policy import DENSE, SCHEME, Auto, Policy, cheapest_plans, measure_route
from hvd_compress.schemes.base import Scheme

TCP_HEADER_SHARE = 66 / 1448
"""Ethernet (14), IP (20) and TCP with timestamps (32) bytes per 1448-byte segment."""

SHM_PASSES = 2
"""Passes over each byte a rank sends through shared memory inside its host: its write into
its segment and the peer's copy out (the in-host sum of a reduce-scatter is done as the copy
runs, :meth:`~hvd_compress.comm.shm.ShmHostCommunicator.wait_sum`)."""

ROUTES = ("native", "allgather", "ps")
SPLITS = ("rounds", "slices", "tensors")
"""Two-level routes (:func:`two_level_split`; module docstring)."""
SERVER_MODES = ("union", "topk", "gtopk")
"""The servers' ``--mode`` values (``ps_server.rounds.MODES``, which this module does not
import)."""


@dataclass(frozen=True)
class Cluster:
    """The machines and their links.

    Args:
        hosts: hosts ``W``. per_host: ranks (GPUs) per host ``L``.
        rate_bits: each host's network link, bits per second each way.
        latency_s: one-way latency of a hop between hosts.
        intra_bits: the link between ranks of one host, bits per second (0: unlimited).
        intra_latency_s: one-way latency of a hop between ranks of one host (the in-host
            collectives of two-level's ``rounds`` route).
        intra_shm: two-level's in-host stage goes through shared memory
            (:mod:`hvd_compress.comm.shm`, the default on x86-64) instead of Horovod's
            collectives: no cycle, and each byte a rank sends inside the host costs
            :data:`SHM_PASSES` passes (written to its segment, copied out by the peer) at
            ``copy_bytes_per_s`` times ``codec_scale``, on the cores that compute, instead
            of ``intra_bits``.
        cycle_s: fixed cost per round and kind of collective (Horovod's cycle time; 0 for
            DDP or NCCL; :func:`hvd_compress.cost_model.step_cycles`).
        header_share: protocol bytes per payload byte on the host link.
        cpu_s_per_byte: host CPU seconds per byte through the network stack.
        codec_scale: factor on codec and pass seconds measured here (ranks per core).
        codec_bytes_per_s: a given codec throughput (float32 bytes in per second per
            rank); replaces the measured codec seconds.
        copy_bytes_per_s: throughput of the pipeline's passes (``passes`` in the module
            notes): float32 bytes of gradient per second.
        compute_s: forward, backward and update seconds per step.
        server_pairs_per_s: pairs a server shard sums per second.
        gather_factor: transfer seconds of all-to-all and all-gather rounds over what the
            link's rate gives (1: as fast as a ring all-reduce).
        reduce_s_per_byte: seconds per all-reduce payload byte of the reduction's own
            arithmetic (a CPU summing float16).
        stock_s_per_byte: more CPU seconds per byte moved in stock Horovod's own data
            path (its fusion buffer and averaging), added to ``cpu_s_per_byte`` for its rows.
        overlap: the hosts' CPU work per byte runs while the link sends (a collective then
            takes the longer of its wire time and its CPU time); else one after the other.
        server_round_s: fixed seconds of each server round of a tensor beyond its bytes and
            hops: its push and pull calls' own handling on the worker and the server (on the
            emulated cluster, also their turns on the shared cores); 0 by default. A server
            round waits for no Horovod cycle.
        cores: processors that every rank of the cluster shares (the emulated cluster: all
            its ranks on one machine's cores); 0 (default): each rank has its own, as on a
            GPU cluster. With more ranks than cores, part of a server round's transfer runs
            while ranks compute (module docstring, "Ranks sharing cores").
    """

    hosts: int
    per_host: int = 1
    rate_bits: float = 10e9
    latency_s: float = 0.0
    intra_bits: float = 0.0
    intra_latency_s: float = 0.0
    intra_shm: bool = False
    cycle_s: float = 0.0
    header_share: float = 0.0
    cpu_s_per_byte: float = 0.0
    codec_scale: float = 1.0
    codec_bytes_per_s: float | None = None
    copy_bytes_per_s: float = 5e9
    compute_s: float = 0.0
    server_pairs_per_s: float = 30e6
    gather_factor: float = 1.0
    reduce_s_per_byte: float = 0.0
    stock_s_per_byte: float = 0.0
    overlap: bool = False
    server_round_s: float = 0.0
    cores: float = 0.0

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.per_host < 1:
            raise ValueError(f"hosts and per_host must be >= 1, got {self.hosts} x "
                             f"{self.per_host}")
        if self.rate_bits <= 0:
            raise ValueError(f"rate_bits must be > 0, got {self.rate_bits}")
        if self.cores < 0:
            raise ValueError(f"cores must be >= 0 (0: a processor per rank), got {self.cores}")

    @property
    def ranks(self) -> int:
        return self.hosts * self.per_host

    @property
    def contention(self) -> float:
        """Ranks per core where the ranks share ``cores`` (at least 1); 1 where each rank
        has its own processor."""
        return max(self.ranks / self.cores, 1.0) if self.cores > 0 else 1.0

    @property
    def wire_s_per_byte(self) -> float:
        """Seconds per byte on a host's network link."""
        return self.net_s_per_byte + (0.0 if self.overlap else self.cpu_s_per_byte)

    @property
    def net_s_per_byte(self) -> float:
        """Seconds per byte of the link's rate and protocol headers alone."""
        return 8 * (1 + self.header_share) / self.rate_bits

    @property
    def intra_s_per_byte(self) -> float:
        """Seconds per byte a rank sends inside its host: a flat ring's edges there at
        ``intra_bits``."""
        return 8 / self.intra_bits if self.intra_bits > 0 else 0.0

    @property
    def in_host_s_per_byte(self) -> float:
        """Seconds per byte a rank sends in two-level's in-host stage: through shared
        memory (``intra_shm``) or at ``intra_bits``."""
        if self.intra_shm:
            return SHM_PASSES * self.codec_scale / self.copy_bytes_per_s
        return self.intra_s_per_byte


@dataclass(frozen=True)
class Job:
    """What is trained and how it exchanges.

    Args:
        tensors: name -> shape of every gradient.
        scheme: a :meth:`~hvd_compress.Compression.parse` spec (``auto:...`` too).
        two_level: ``hierarchy="host"``, by the route of ``split`` (module docstring).
        route: ``native`` (each round as the scheme asks), ``allgather`` (the same: sparse
            rounds by all-gather) or ``ps`` (sparse rounds through a parameter server).
        shards: server shards, each on its own host link. server_mode: ``union`` (a pull
            carries the union of the pushes), ``topk`` or ``gtopk`` (re-sparsified to one
            push's size).
        fusion_bytes: the largest fused collective (Horovod's fusion threshold, DDP's
            bucket); a round's requests above it take more collectives.
        element_bytes: bytes per element of a dense all-reduce: 4, or 2 for float16 cast
            before a ring all-reduce (Horovod's ``Compression.fp16``, DDP's fp16 hook),
            which costs two passes (cast and back).
        pipeline: hvd-compress's pipeline runs (its passes over the gradients count);
            off for stock Horovod and DDP.
        split: two-level's route, one of :data:`SPLITS`; ``None``: the one the scheme
            takes (:func:`two_level_split`).
        gloo: ``collectives="gloo"``: every collective on a Gloo group, top-k's all-gather
            of frames too, so only server rounds pay Horovod's cycle
            (:func:`~hvd_compress.cost_model.step_cycles`).
    """

    tensors: Mapping[str, tuple[int, ...]]
    scheme: str = "none"
    two_level: bool = False
    route: str = "native"
    shards: int = 1
    server_mode: str = "union"
    fusion_bytes: float = 64 << 20
    element_bytes: int = 4
    pipeline: bool = True
    split: str | None = None
    gloo: bool = False

    @property
    def cycled(self) -> tuple[str, ...]:
        """The kinds of collective that wait for Horovod's cycle."""
        return () if self.gloo else KINDS

    def __post_init__(self) -> None:
        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.element_bytes not in (2, 4):
            raise ValueError(f"element_bytes must be 2 or 4, got {self.element_bytes}")
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if self.server_mode not in SERVER_MODES:
            raise ValueError(f"server_mode must be one of {', '.join(SERVER_MODES)}, got "
                             f"{self.server_mode!r}")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")


# Measuring a route ---------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """A route of one shape, measured at 2 and 4 ranks: per round its kind and request
    bytes ``a + b / p`` (an all-gather of chunks shrinks with ``p``), and codec seconds
    ``c + d p`` (an all-gather's decode grows with ``p``), the route's commit included
    (``measure_route(..., commit=True)``)."""

    kinds: tuple[str, ...]
    payload: tuple[tuple[float, float], ...]
    codec: tuple[float, float]

    def payloads(self, ranks: int) -> tuple[float, ...]:
        return tuple(max(a + b / ranks, 0.0) for a, b in self.payload)

    def codec_s(self, ranks: int) -> float:
        c, d = self.codec
        return max(c + d * ranks, 0.0)


def _fit(two: float, four: float, inverse: bool) -> tuple[float, float]:
    """``(a, b)`` of ``a + b / p`` (``inverse``) or ``a + b p`` through p = 2 and 4."""
    if inverse:
        b = (two - four) * 4  # two - four = b (1/2 - 1/4)
        return two - b / 2, b
    d = max((four - two) / 2, 0.0)
    return (two - 2 * d if d > 0 else min(two, four)), d


BIG = 16 << 20
"""Tensors of more elements are measured once per rank count, not ``repeats`` times."""


PROFILES: dict[tuple[str, str, tuple[int, ...]], Profile] = {}
"""Every route measured in this process (or loaded by :func:`load_profiles`), by (scheme
spec, route, shape): measured once, reused by every prediction."""


def profile(spec: str, route: str, shape: tuple[int, ...], repeats: int = 5) -> Profile:
    """Measure ``route`` (``dense``, ``fp16`` or ``scheme``) of scheme ``spec`` on a tensor
    of ``shape`` (:func:`hvd_compress.policy.measure_route`, CPU, at 2 and 4 ranks, the
    fastest of ``repeats``), unless :data:`PROFILES` has it."""
    key = (spec, route, tuple(shape))
    if key in PROFILES:
        return PROFILES[key]
    scheme = _route_scheme(spec, route)
    cpu = torch.device("cpu")
    if math.prod(shape) > BIG:
        repeats = 1
    two, four = (measure_route(scheme, torch.Size(shape), 0, p, cpu, repeats, commit=True)
                 for p in (2, 4))
    if two.kinds != four.kinds:
        raise RuntimeError(f"{spec} on {shape}: rounds differ between 2 and 4 ranks "
                           f"({two.kinds} vs {four.kinds}); the model cannot extrapolate")
    payload = tuple(_fit(a, b, True) for a, b in zip(two.payloads, four.payloads, strict=True))
    PROFILES[key] = Profile(two.kinds, payload, _fit(two.compute, four.compute, False))
    return PROFILES[key]


def save_profiles(path: Path) -> None:
    """Write :data:`PROFILES` as JSON, so that a check can be rerun on the same codec
    measurements (``--profiles``)."""
    rows = [{"spec": spec, "route": route, "shape": list(shape), "kinds": list(p.kinds),
             "payload": [list(ab) for ab in p.payload], "codec": list(p.codec),
             "commit": True}
            for (spec, route, shape), p in sorted(PROFILES.items(), key=str)]
    Path(path).write_text(json.dumps(rows, indent=1) + "\n")


def load_profiles(path: Path) -> int:
    """Add the measurements of a :func:`save_profiles` file to :data:`PROFILES`; returns
    how many. Rows measured before the codec held the route's commit (no ``commit`` key,
    files before ``--profiles`` recorded it) are left out: those routes are measured
    again."""
    rows = [row for row in json.loads(Path(path).read_text()) if row.get("commit")]
    for row in rows:
        PROFILES[(row["spec"], row["route"], tuple(row["shape"]))] = Profile(
            tuple(row["kinds"]), tuple((float(a), float(b)) for a, b in row["payload"]),
            (float(row["codec"][0]), float(row["codec"][1])))
    return len(rows)


@cache
def _route_scheme(spec: str, route: str) -> Scheme:
    parsed = Compression.parse(spec)
    if isinstance(parsed, Auto):
        return parsed.candidates()[route]
    if route == SCHEME:
        return parsed
    return Compression.parse("none" if route == DENSE else "fp16")


@cache
def _allowed(spec: str, shape: tuple[int, ...]) -> bool:
    parsed = Compression.parse(spec)
    scheme = parsed.scheme if isinstance(parsed, Auto) else parsed
    return Policy().compresses(scheme, torch.Size(shape))


@cache
def scheme_routes(spec: str) -> tuple[str, ...]:
    """Routes a tensor of this scheme may take: ``scheme`` and ``dense``; with ``auto``
    also ``fp16``."""
    parsed = Compression.parse(spec)
    if isinstance(parsed, Auto):
        return tuple(parsed.candidates())
    return (SCHEME, DENSE)


# Bytes per link ------------------------------------------------------------------------
def host_bytes(kind_: str, payload: float, ranks: int, per_host: int) -> float:
    """Bytes on one host's network link for a request of ``payload`` bytes on each of
    ``ranks`` ranks, ``per_host`` of them on each host, in a flat collective: a ring (ranks
    of a host adjacent) crosses each host link once, so a host carries one rank's ring
    bytes; an all-to-all sends each rank's parts for other hosts; a server gets every
    rank's push and pull."""
    if ranks <= per_host:
        return 0.0
    if kind_ == ALLTOALL:
        return per_host * (ranks - per_host) / ranks * payload
    if kind_ == SERVER:
        return per_host * link_bytes(SERVER, payload, ranks)
    return link_bytes(kind_, payload, ranks)


def pull_bytes(push: float, numel: int, density_pairs: float, workers: int, mode: str) -> float:
    """A pull's bytes: the top-k modes one push's size; ``union`` the expected union of
    ``workers`` independent pushes of ``density_pairs`` pairs among ``numel`` elements,
    ``numel (1 - (1 - k / numel) ** workers)`` pairs, at the push's bytes per pair."""
    if mode in ("topk", "gtopk") or density_pairs <= 0:
        return push
    union = numel * (1 - (1 - min(density_pairs / numel, 1.0)) ** workers)
    return push * union / density_pairs


# Predicting ----------------------------------------------------------------------------
@dataclass
class Prediction:
    """A step's predicted seconds by term, with the bytes a worker host sends (for a
    ring as many as it receives; through a server its pushes)."""

    step_s: float
    terms: dict[str, float]
    host_bytes: float
    collectives: int
    routes: dict[str, str]

    def row(self) -> dict[str, Any]:
        return {"step_s": self.step_s, **{f"{k}_s": v for k, v in self.terms.items()},
                "host_mb": self.host_bytes / 1e6, "collectives": self.collectives,
                "routes": dict(sorted(self.routes.items()))}


@cache
def _pairs(shape: tuple[int, ...], spec: str) -> float:
    """Pairs a sparse scheme sends for ``shape`` (its ratio times the elements)."""
    scheme = _route_scheme(spec, SCHEME)
    numel = math.prod(shape)
    ratio = getattr(scheme, "ratio", None) or getattr(scheme, "density", None)
    return numel * float(ratio) if ratio else numel / max(scheme.compression_rate(
        torch.Size(shape)), 1.0)


def _slice(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    return (math.ceil(shape[0] / parts), *shape[1:]) if shape else shape


def two_level_split(scheme: Scheme) -> str:
    """The route ``hierarchy="host"`` takes for ``scheme``, as
    :func:`hvd_compress.hierarchy.two_level_pipeline` and ``split_of`` choose it:
    ``rounds`` when its :attr:`~hvd_compress.schemes.base.Scheme.linear_rounds`, else
    ``slices`` when ``sliceable``, else ``tensors``."""
    if scheme.linear_rounds:
        return "rounds"
    return "slices" if scheme.sliceable else "tensors"


class Model:
    """Predicts one :class:`Job` on one :class:`Cluster` (module docstring)."""

    def __init__(self, job: Job, cluster: Cluster) -> None:
        self.job, self.cluster = job, cluster
        parsed = Compression.parse(job.scheme)
        inner = parsed.scheme if isinstance(parsed, Auto) else parsed
        self.split = (job.split or two_level_split(inner)) if job.two_level else None
        self.leader = self.split == "tensors"
        self.rounds = self.split == "rounds" and cluster.per_host > 1
        self.error_feedback = bool(inner.error_feedback)
        self.true_bytes: dict[tuple[str, str], float] = {}
        self.rank_bytes: dict[tuple[str, str], float] = {}
        # per (tensor, route): bytes of its server rounds on the busiest link, and the
        # server's summing seconds (CPU of the server, not of the ranks)
        self.server_sent: dict[tuple[str, str], float] = {}
        self.summing: dict[tuple[str, str], float] = {}

    # participants of the compressed exchange and the tensor each one codes
    def _peers(self) -> int:
        """Participants of a cross-host collective: ``W`` two-level, ``W L`` flat."""
        c = self.cluster
        return c.hosts if self.job.two_level and c.per_host > 1 else c.ranks

    def _coded_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        c = self.cluster
        if not self.job.two_level or c.per_host == 1 or self.leader or self.rounds:
            return shape
        return _slice(shape, c.per_host)

    def route_cost(self, name: str, route: str) -> RouteCost:
        """A tensor's route: codec seconds and bytes on its host's link, with each
        round's kind (sparse rounds through a server become ``server``)."""
        job, c = self.job, self.cluster
        shape = self._coded_shape(tuple(job.tensors[name]))
        prof = profile(job.scheme, route, shape)
        peers = self._peers()
        numel = math.prod(shape)
        # rounds: the flat algorithm, its codec and requests those of W L ranks
        coding = c.ranks if self.rounds else peers
        if c.codec_bytes_per_s:
            coded = _route_scheme(job.scheme, route).name != "none"
            codec = 4 * numel / c.codec_bytes_per_s if coded else 0.0
        else:
            codec = prof.codec_s(coding) * c.codec_scale
        # a host carries per_host slices (two-level), or per_host ranks' traffic (flat)
        sharing = c.per_host if job.two_level and not self.leader else 1
        sent, kinds, payloads = 0.0, [], list(prof.payloads(coding))
        if _route_scheme(job.scheme, route).name == "none":
            payloads = [b * job.element_bytes / 4 for b in payloads]
        true = ring = server_bytes = summed = 0.0
        # rounds: each local rank all-reduces 1 / L of every request across the hosts
        across = 1 / c.per_host if self.rounds else 1.0
        for what, full in zip(prof.kinds, payloads, strict=True):
            payload = full * across
            if what == SPARSE and job.route == "ps":
                busiest, summing = self._server_round(payload, shape, peers)
                sent += sharing * busiest
                server_bytes += sharing * busiest
                true += sharing * (1 if job.two_level else c.per_host) * payload
                codec += summing
                summed += summing
                kinds.append(SERVER)
                continue
            per_host = 1 if job.two_level and c.per_host > 1 else c.per_host
            moved = sharing * host_bytes(what, payload, peers, per_host)
            ring += link_bytes(what, payload, peers)
            true += moved
            sent += moved * (c.gather_factor if what != ALLREDUCE else 1.0)
            if what == ALLREDUCE:
                codec += payload * c.reduce_s_per_byte
            kinds.append(what)
        self.true_bytes[(name, route)] = true
        self.rank_bytes[(name, route)] = ring
        self.server_sent[(name, route)] = server_bytes
        self.summing[(name, route)] = summed
        return RouteCost(codec, sent, tuple(kinds), tuple(payloads))

    def _server_round(self, push: float, shape: tuple[int, ...],
                      peers: int) -> tuple[float, float]:
        """A server round: ``(bytes, seconds)``, the bytes on the busier of a worker's host
        link and a shard's, pushes in then pulls out, and the shards' summing time."""
        job, c = self.job, self.cluster
        pairs = _pairs(shape, job.scheme)
        pull = pull_bytes(push, math.prod(shape), pairs, peers, job.server_mode)
        per_host = 1 if job.two_level else c.per_host
        _, shard_in = server_bytes(push, 0.0, peers, job.shards)
        _, shard_out = server_bytes(0.0, pull, peers, job.shards)
        return (max(per_host * push, shard_in) + max(per_host * pull, shard_out),
                peers * pairs / job.shards / c.server_pairs_per_s)

    def costs(self) -> dict[str, dict[str, RouteCost]]:
        """Every tensor's allowed routes (the :class:`Policy` keeps biases and small
        tensors dense, as in a run)."""
        out: dict[str, dict[str, RouteCost]] = {}
        for name, shape in self.job.tensors.items():
            routes = [r for r in scheme_routes(self.job.scheme)
                      if r != SCHEME or _allowed(self.job.scheme, tuple(shape))]
            out[name] = {r: self.route_cost(name, r) for r in routes}
        return out

    def routes(self, costs: Mapping[str, Mapping[str, RouteCost]]) -> dict[str, str]:
        """A fixed scheme where the policy allows it; ``auto`` chooses as
        ``Compression.auto`` does, from the same plans (:func:`~hvd_compress.policy.
        cheapest_plans`)."""
        if not isinstance(Compression.parse(self.job.scheme), Auto):
            return {n: SCHEME if SCHEME in c else DENSE for n, c in costs.items()}
        link = self._link()
        return min(cheapest_plans(costs, link), key=lambda plan: predict(costs, plan, link))

    def _link(self) -> LinkModel:
        """``Compression.auto``'s link: a cycle per collective, none on a Gloo group."""
        c = self.cluster
        return LinkModel(0.0 if self.job.gloo else c.cycle_s, c.wire_s_per_byte)

    def predict(self) -> Prediction:
        """The step's seconds by term (module docstring), with the routes ``auto`` or the
        policy chose."""
        job, c = self.job, self.cluster
        costs = self.costs()
        routes = self.routes(costs)
        link = self._link()
        kinds = step_collectives(costs, routes)
        fused = self._fusion_split(costs, routes)
        numel = sum(math.prod(s) for s in job.tensors.values())
        if c.codec_bytes_per_s:  # a given codec: every write, and the subtraction, pass too
            passed = (1 + 2 * self.error_feedback) * job.pipeline * numel
        else:  # a measured codec holds its route's commit: error feedback's g + e remains
            passed = self.error_feedback * job.pipeline * sum(
                math.prod(job.tensors[n]) for n, r in routes.items() if r == SCHEME)
        passed += 2 * (job.element_bytes == 2) * numel
        passes = 4 * passed / c.copy_bytes_per_s * c.codec_scale
        cycles = step_cycles(costs, routes, job.cycled)
        # the exchange: every route's seconds, a cycle per round and kind (not the
        # per-collective latency of cost_model.predict, which Compression.auto uses), and
        # each server round's own fixed cost
        server_rounds = sum(costs[n][r].kinds.count(SERVER) for n, r in routes.items())
        exchange = sum(costs[n][r].seconds(link) for n, r in routes.items()) + \
            c.cycle_s * cycles + c.server_round_s * server_rounds
        hop = c.latency_s * sum(hops(k, self._peers()) for k in kinds + fused)
        intra = self._intra_seconds(costs, routes)
        inside = self._in_host_collectives(cycles, kinds, fused)
        terms = {"compute": c.compute_s, "passes": passes,
                 "codec": sum(costs[n][r].compute for n, r in routes.items()),
                 "transfer": sum(costs[n][r].send_bytes for n, r in routes.items())
                 * link.seconds_per_byte,
                 "collectives": c.cycle_s * cycles + hop + inside, "intra": intra,
                 "server_rounds": c.server_round_s * server_rounds}
        sent = sum(self.true_bytes[(n, r)] for n, r in routes.items())
        wire = terms["transfer"]
        cpu = sent * c.cpu_s_per_byte if c.overlap else 0.0
        terms["cpu_beyond_wire"] = max(cpu - wire, 0.0)
        terms["server_overlap"] = self._server_overlap(routes, terms, link)
        step = (c.compute_s + passes + exchange + hop + inside + intra
                + terms["cpu_beyond_wire"] - terms["server_overlap"])
        count = (len(kinds) + len(fused)) * (3 if self.rounds else 1)
        return Prediction(step, terms, sent, count, routes)

    def _server_overlap(self, routes: Mapping[str, str], terms: Mapping[str, float],
                        link: LinkModel) -> float:
        """Seconds of the server rounds' transfer that run while ranks compute, on ranks
        that share cores (module docstring, "Ranks sharing cores"): the transfer, at most
        the ranks' CPU seconds times ``1 - 1 / contention``."""
        c = self.cluster
        if c.contention <= 1:
            return 0.0
        server_bytes = sum(self.server_sent[(n, r)] for n, r in routes.items())
        summing = sum(self.summing[(n, r)] for n, r in routes.items())
        cpu = terms["compute"] + terms["passes"] + terms["codec"] - summing + (
            terms["intra"] if c.intra_shm else 0.0)  # shared memory: passes on the cores
        return min(server_bytes * link.seconds_per_byte, cpu * (1 - 1 / c.contention))

    def _in_host_collectives(self, rounds: int, kinds: Sequence[str],
                             fused: Sequence[str]) -> float:
        """Two-level ``rounds``: each cross-host all-reduce has an in-host reduce-scatter
        and all-gather around it, each a collective of its own (a cycle per round, ``L - 1``
        in-host hops per collective)."""
        c = self.cluster
        if not self.rounds:
            return 0.0
        cycle = 0.0 if c.intra_shm else c.cycle_s  # shared memory: no Horovod negotiation
        return 2 * (cycle * rounds
                    + c.intra_latency_s * (c.per_host - 1) * (len(kinds) + len(fused)))

    def in_host_bytes(self, costs: Mapping[str, Mapping[str, RouteCost]],
                      routes: Mapping[str, str]) -> float:
        """Bytes a rank sends inside its host per step, two-level: ``rounds`` the in-host
        reduce-scatter and all-gather of every round's request, ``2 (L - 1) / L * b``;
        ``slices`` and ``tensors`` those of the dense gradient, ``2 (L - 1) / L * 4 n``;
        0 flat or with one rank per host."""
        c = self.cluster
        if not self.job.two_level or c.per_host == 1:
            return 0.0
        share = 2 * (c.per_host - 1) / c.per_host
        if self.rounds:
            return share * sum(sum(costs[n][r].payloads) for n, r in routes.items())
        return share * 4 * sum(math.prod(s) for s in self.job.tensors.values())

    def _fusion_split(self, costs: Mapping[str, Mapping[str, RouteCost]],
                      routes: Mapping[str, str]) -> list[str]:
        """The kinds of the collectives beyond one per fused round: the tensors of a round
        are fused in buckets of ``fusion_bytes`` of gradient, so a round over more takes
        ``ceil(bytes / fusion_bytes)`` collectives. They run in the same negotiation cycle
        (Horovod starts every fused response that is ready), so they add hops, no cycle."""
        total: dict[tuple[int, str], float] = {}
        for name, route in routes.items():
            grad = math.prod(self.job.tensors[name]) * self.job.element_bytes
            for i, what in enumerate(costs[name][route].kinds):
                if what not in (SPARSE, SERVER):
                    total[(i, what)] = total.get((i, what), 0.0) + grad
        return [what for (_, what), b in total.items()
                for _ in range(max(math.ceil(b / self.job.fusion_bytes), 1) - 1)]

    def _intra_seconds(self, costs: Mapping[str, Mapping[str, RouteCost]],
                       routes: Mapping[str, str]) -> float:
        """Two-level: :meth:`in_host_bytes` at :attr:`Cluster.in_host_s_per_byte`
        (``rounds``: the requests'; else the dense gradient's); flat: a ring's edges
        inside a host carry one rank's bytes at the intra rate, counted where that takes
        longer than the host link's share (the edges work at once)."""
        c = self.cluster
        if c.per_host == 1:
            return 0.0
        if self.job.two_level:
            return self.in_host_bytes(costs, routes) * c.in_host_s_per_byte
        if c.intra_s_per_byte == 0:
            return 0.0
        inside = sum(self.rank_bytes[(n, r)] for n, r in routes.items()) * c.intra_s_per_byte
        between = sum(self.true_bytes[(n, r)] for n, r in routes.items()) * c.wire_s_per_byte
        return max(inside - between, 0.0)


def predict_job(job: Job, cluster: Cluster) -> Prediction:
    """The predicted step of ``job`` on ``cluster``."""
    return Model(job, cluster).predict()


# Tensors -------------------------------------------------------------------------------
def gpt_tensors(params: float, d: int = 2048, vocab: int = 50304) -> dict[str, tuple[int, ...]]:
    """A GPT-style decoder of about ``params`` parameters: embeddings ``vocab x d``, then
    layers of ``3d x d`` (QKV), ``d x d``, ``4d x d``, ``d x 4d`` with their biases and two
    layer norms; as many layers as fit (at least one)."""
    per_layer = 12 * d * d + 13 * d
    layers = max(round((params - vocab * d) / per_layer), 1)
    out: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
    for i in range(layers):
        for part, shape in (("qkv", (3 * d, d)), ("proj", (d, d)), ("fc1", (4 * d, d)),
                            ("fc2", (d, 4 * d))):
            out[f"h{i}.{part}.weight"] = shape
            out[f"h{i}.{part}.bias"] = (shape[0],)
        out[f"h{i}.ln1"], out[f"h{i}.ln2"] = (2 * d,), (2 * d,)
    return out


def model_tensors(name: str) -> dict[str, tuple[int, ...]]:
    """Shapes of a ``bench cluster`` model's parameters, or ``gpt-1.3b``."""
    if name == "gpt-1.3b":
        return gpt_tensors(1.3e9)
    from hvd_compress.bench.cluster_rank import MODELS

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose gpt-1.3b or one of "
                         f"{', '.join(MODELS)}")
    return {n: tuple(p.shape) for n, p in MODELS[name].build(0).named_parameters()}


def load_plan(path: Path) -> dict[str, tuple[int, ...]]:
    """A saved per-tensor plan: JSON ``{name: shape}`` or ``[{"name", "shape"}, ...]``."""
    data = json.loads(Path(path).read_text())
    items = data.items() if isinstance(data, dict) else ((d["name"], d["shape"]) for d in data)
    plan = {str(n): tuple(int(x) for x in s) for n, s in items}
    if not plan:
        raise ValueError(f"{path}: the plan names no tensors")
    return plan


def copy_throughput(numel: int = 16 << 20, repeats: int = 5) -> float:
    """Bytes per second of a float32 tensor copy on this CPU (median of ``repeats``)."""
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return 4 * numel / sorted(times)[len(times) // 2]


def table(tensors: Mapping[str, tuple[int, ...]], schemes: Sequence[str],
          gpus: Iterable[int], rates_gbit: Iterable[float], base: Cluster,
          progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every scheme, flat and two-level, dense route and server, at every size and rate:
    one row each, with the predicted step and its terms."""
    rows = []
    for rate in rates_gbit:
        for n in gpus:
            hosts = max(n // base.per_host, 1)
            cluster = dataclasses.replace(base, hosts=hosts, rate_bits=rate * 1e9)
            for spec in schemes:
                for two_level in (False, True):
                    if two_level and cluster.per_host == 1:
                        continue
                    for route in _table_routes(spec):
                        job = _table_job(tensors, spec, two_level, route, hosts)
                        pred = predict_job(job, cluster)
                        rows.append({"gpus": hosts * cluster.per_host, "hosts": hosts,
                                     "rate_gbit": rate, "scheme": spec,
                                     "two_level": two_level, "route": route,
                                     **{k: v for k, v in pred.row().items() if k != "routes"}})
            progress(f"{rate:g} Gbit/s, {n} GPUs done")
    return rows


def _table_job(tensors: Mapping[str, tuple[int, ...]], spec: str, two_level: bool,
               route: str, hosts: int) -> Job:
    """``fp16`` is a float16 ring all-reduce (what the FP16 scheme sends off the CPU, and
    what NCCL sums); a server has one shard per host (as BytePS places them)."""
    if spec == "fp16":
        return Job(tensors, "none", two_level, route, element_bytes=2)
    return Job(tensors, spec, two_level, route, shards=hosts)


def _table_routes(spec: str) -> tuple[str, ...]:
    kinds = set(profile(spec, SCHEME, (1024, 1024)).kinds) if spec != "none" else set()
    return ("allgather", "ps") if SPARSE in kinds else ("native",)


def crossover(tensors: Mapping[str, tuple[int, ...]], schemes: Sequence[str], gpus: int,
              base: Cluster, low: float = 1.0, high: float = 1e5) -> float | None:
    """The host link rate (Gbit/s) above which no compressed configuration of ``schemes``
    beats the fastest dense one (``none`` flat or two-level) on ``gpus`` GPUs: bisection
    on a log scale in ``[low, high]``; ``None`` if compression still pays at ``high``, 0
    if it does not pay even at ``low``."""
    hosts = max(gpus // base.per_host, 1)

    def gain(rate: float) -> float:
        rows = table(tensors, schemes, [hosts * base.per_host], [rate], base)
        dense = min(r["step_s"] for r in rows if r["scheme"] == "none")
        return dense - min(r["step_s"] for r in rows if r["scheme"] != "none")

    if gain(high) > 0:
        return None
    if gain(low) <= 0:
        return 0.0
    for _ in range(20):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if gain(mid) > 0 else (low, mid)
    return math.sqrt(low * high)


def winners(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (rate, GPUs): the fastest configuration, the fastest dense one (``none``, flat
    or two-level) and the speedup of the winner over it."""
    out = []
    keys = sorted({(r["rate_gbit"], r["gpus"]) for r in rows})
    for rate, gpus in keys:
        here = [r for r in rows if r["rate_gbit"] == rate and r["gpus"] == gpus]
        best = min(here, key=lambda r: r["step_s"])
        dense = min((r for r in here if r["scheme"] == "none"), key=lambda r: r["step_s"])
        out.append({"rate_gbit": rate, "gpus": gpus, "best": _label(best),
                    "best_s": best["step_s"], "dense": _label(dense),
                    "dense_s": dense["step_s"], "speedup": dense["step_s"] / best["step_s"]})
    return out


def _label(row: Mapping[str, Any]) -> str:
    route = "" if row["route"] == "native" else f"@{row['route']}"
    return f"{row['scheme']}{route}{' two-level' if row['two_level'] else ' flat'}"


# Checking against the emulated cluster -------------------------------------------------
FITS: tuple[tuple[str, str, str, str], ...] = (
    ("codec_scale", "hvd-compress", "powersgd:rank=4,start_iter=2", "1gbit"),
    ("cpu_s_per_byte", "hvd-compress", "none", "10gbit"),
    ("gather_factor", "hvd-compress", "fp16", "100mbit"),
    ("stock_s_per_byte", "horovod-mpi", "none", "10gbit"),
    ("reduce_s_per_byte", "horovod", "fp16", "10gbit"),
    ("server_round_s", "hvd-compress", "topk:ratio=0.001@gloo@ps", "10gbit"),
)
"""The parameters fitted to the emulated cluster, in this order, each to one row (system,
scheme, link) of the run: the rest of the rows are predictions. A run without a row of
:data:`OPTIONAL_FITS` leaves that term as it was given."""

OPTIONAL_FITS = ("server_round_s",)
"""Fitted terms whose row a fit run may lack (a run without a parameter server)."""

STOCK_ONLY = ("stock_s_per_byte", "reduce_s_per_byte")
"""Fitted terms that belong to stock Horovod (its optimizer's per-step cost; Gloo summing
float16), applied to its rows only (``reduce_s_per_byte`` to the Gloo controller's)."""


class UnknownRoute(ValueError):
    """A row the model does not predict: a two-level row of a ``linear_rounds`` scheme that
    does not record which route it ran (:func:`row_split`), or a floor row that runs no
    system (``rounds-powersgd``)."""


def row_split(row: Mapping[str, Any]) -> str:
    """The two-level route a ``SPEC@host`` row of a ``linear_rounds`` scheme (PowerSGD)
    ran, from the byte counts its pipeline recorded (``collective_bytes``): ``rounds``
    when its in-host collectives (``"host"``) were handed at most twice its other rounds'
    bytes (the factor route hands each round's request to the reduce-scatter and ``1 / L``
    of it to the all-gather), ``tensors`` (the dense sum inside the host, the route before
    ``linear_rounds``) when more (the dense gradient: 50 MB against 0.08 MB of factors on
    mlp8m). The rows' settings are the same for both routes, so a row without those
    counts raises :class:`UnknownRoute`."""
    handed = {k: float(v) for k, v in (row.get("collective_bytes") or {}).items()}
    if "host" not in handed:
        raise UnknownRoute(f"{row.get('scheme')}: the row records no in-host bytes "
                           "(collective_bytes['host']), so whether it summed the factors "
                           "or the dense gradient inside the host is unknown")
    rounds = sum(v for k, v in handed.items() if k != "host")
    return "rounds" if handed["host"] <= 2 * rounds else "tensors"


def row_case(row: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]],
             base: Cluster, hook_s: float) -> tuple[Job, Cluster]:
    """The job and cluster of one ``bench cluster`` row: its system (hvd-compress's
    pipeline; stock Horovod: one fused all-reduce; DDP: 25 MB buckets, no cycle; DDP's
    PowerSGD hook taking ``hook_s`` seconds per step), scheme, link rate and latency,
    hosts and ranks per host (``SPEC@host``: two-level, a ``linear_rounds`` scheme's route
    from :func:`row_split`, which raises :class:`UnknownRoute`) and Horovod cycle time."""
    system, scheme = str(row["system"]), str(row["scheme"])
    settings = row.get("settings") or {}
    cycle = float(settings.get("HOROVOD_CYCLE_TIME", 0)) / 1e3
    per_host = int(row.get("ranks_per_host") or 1)  # several ranks per host's namespace
    cluster = dataclasses.replace(base, hosts=int(row.get("hosts") or row["ranks"]),
                                  per_host=per_host,
                                  rate_bits=float(row["link_bits"]),
                                  latency_s=float(row.get("latency_ms") or 0) / 1e3,
                                  cycle_s=cycle)
    stock = not system.startswith("hvd-compress")
    if stock:
        gloo_fp16 = system == "horovod" and scheme == "fp16"
        cluster = dataclasses.replace(
            cluster, cpu_s_per_byte=base.cpu_s_per_byte + (
                base.stock_s_per_byte if system.startswith("horovod") else 0.0),
            reduce_s_per_byte=base.reduce_s_per_byte if gloo_fp16 else 0.0)
    else:
        cluster = dataclasses.replace(cluster, reduce_s_per_byte=0.0)
    if system == "ddp":
        from hvd_compress.bench.cluster_rank import ROUNDS

        if scheme.startswith(ROUNDS):
            raise UnknownRoute(f"{scheme}: a floor (collectives alone), not a system")
        bucket = float(settings.get("bucket_cap_mb") or 25) * (1 << 20)
        if "powersgd" in scheme:
            coded = sum(math.prod(s) for s in tensors.values() if len(s) > 1)
            cluster = dataclasses.replace(cluster, codec_bytes_per_s=4 * coded / hook_s)
            return Job(tensors, scheme, fusion_bytes=bucket, pipeline=False), cluster
        return Job(tensors, "none", fusion_bytes=bucket, pipeline=False,
                   element_bytes=2 if scheme == "fp16" else 4), cluster
    if stock:
        return Job(tensors, "none", pipeline=False,
                   element_bytes=2 if scheme == "fp16" else 4), cluster
    spec, *where = scheme.split("@")
    two_level = "host" in where
    split = None
    if two_level and _route_scheme(spec, SCHEME).linear_rounds:
        split = row_split(row)
    return Job(tensors, spec, route="ps" if "ps" in where else "native",
               two_level=two_level, split=split, gloo="gloo" in where), cluster


def _find(rows: Sequence[Mapping[str, Any]], system: str, scheme: str,
          link: str) -> Mapping[str, Any]:
    for row in rows:
        if (row["system"], row["scheme"], row["link"]) == (system, scheme, link):
            return row
    raise ValueError(f"the run has no row {system} {scheme} at {link} to fit from")


def _solve(error: Callable[[float], float], high: float) -> float:
    """The root of an increasing ``error`` in ``[0, high]`` by bisection (0 when even 0 is
    too slow: the term cannot be negative)."""
    low = 0.0
    if error(low) >= 0:
        return 0.0
    while error(high) < 0:
        high *= 4
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if error(mid) < 0 else (low, mid)
    return (low + high) / 2


FIT_ROUNDS = 3
"""Passes over :data:`FITS`: each fit moves the others' rows a little, so they are fitted
again until they settle."""

FIT_START = {"cpu_s_per_byte": 1e-8, "gather_factor": 4.0, "codec_scale": 8.0,
             "stock_s_per_byte": 1e-8, "reduce_s_per_byte": 1e-7, "server_round_s": 0.05}


def fit(rows: Sequence[Mapping[str, Any]], tensors: Mapping[str, tuple[int, ...]],
        base: Cluster, hook_s: float, names: Collection[str] | None = None) -> Cluster:
    """``base`` with the :data:`FITS` parameters (or those of them in ``names``) fitted,
    each so that its row's predicted step equals the measured one (bisection; the model's
    step grows with each). A term of :data:`OPTIONAL_FITS` whose row the run lacks keeps
    its value; any other raises ``ValueError``."""
    for name, system, scheme, link in FITS * FIT_ROUNDS:
        if names is not None and name not in names:
            continue
        try:
            row = _find(rows, system, scheme, link)
        except ValueError:
            if name in OPTIONAL_FITS and names is None:
                continue
            raise
        floor = 1.0 if name == "gather_factor" else 0.0

        def error(value: float, name: str = name, row: Mapping[str, Any] = row,
                  base: Cluster = base, floor: float = floor) -> float:
            trial = dataclasses.replace(base, **{name: floor + value})
            job, cluster = row_case(row, tensors, trial, hook_s)
            return predict_job(job, cluster).step_s - float(row["step_s"])

        base = dataclasses.replace(base, **{name: floor + _solve(error, FIT_START[name])})
    return base


def compute_floors(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per model, the mean step of a run's compute floor rows (``system`` ``floor``: the
    same ranks, no exchange). The floor sends nothing, so its time does not depend on the
    link; its rows at several links are repeated measurements of one quantity, and their
    mean is what every row of the model is predicted on."""
    seen: dict[str, list[float]] = {}
    for r in rows:
        if r.get("system") == "floor" and "step_s" in r:
            seen.setdefault(str(r["model"]), []).append(float(r["step_s"]))
    return {m: sum(v) / len(v) for m, v in seen.items()}


def check(rows: Sequence[Mapping[str, Any]], base: Cluster, hook_s: float = 0.1,
          fitted: bool = True, refit: Collection[str] = ()
          ) -> tuple[list[dict[str, Any]], Cluster]:
    """Every step-time row of a ``bench cluster`` run (rows with a ``step_s`` and a model
    of :data:`~hvd_compress.bench.cluster_rank.MODELS`, not the compute floor) predicted
    against its measurement; with ``fitted``, :data:`FITS` first, else the terms in
    ``refit`` (the others as ``base`` gives them). The compute time is the
    mean of the run's own floor rows for the model where it has them
    (:func:`compute_floors`), else ``base.compute_s``. Returns the rows (with
    ``error``, predicted / measured - 1, and ``fitted_here`` for the fit rows) and the
    cluster parameters used."""
    timed = [r for r in rows if "step_s" in r and r.get("system") != "floor"]
    floors = compute_floors(rows)
    out: list[dict[str, Any]] = []
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for row in timed:
        by_model.setdefault(str(row["model"]), []).append(row)
    used = base
    for model, mine in by_model.items():
        tensors = model_tensors(model)
        params = fit(mine, tensors, base, hook_s) if fitted else \
            fit(mine, tensors, base, hook_s, refit) if refit else base
        used = params
        fits = {(s, sc, lk) for n, s, sc, lk in FITS if fitted or n in refit}
        for row in mine:
            floor = floors.get(model)
            here = params if floor is None else dataclasses.replace(params, compute_s=floor)
            measured = float(row["step_s"])
            common = {"system": row["system"], "scheme": row["scheme"],
                      "link": row["link"], "model": model, "measured_s": measured,
                      "fitted_here": (row["system"], row["scheme"], row["link"]) in fits,
                      "measured_mb": float(row.get("tx_payload_bytes_per_step") or 0) / 1e6}
            try:
                job, cluster = row_case(row, tensors, here, hook_s)
            except UnknownRoute as err:
                out.append({**common, "predicted_s": None, "error": None,
                            "predicted_mb": None, "split": None, "not_checked": str(err)})
                continue
            model_ = Model(job, cluster)
            pred = model_.predict()
            out.append({**common, "predicted_s": pred.step_s,
                        "error": pred.step_s / measured - 1,
                        "predicted_mb": pred.host_bytes / 1e6, "split": model_.split,
                        **{f"{k}_s": v for k, v in pred.terms.items()}})
    return out, used



# Command line --------------------------------------------------------------------------
TABLE_SCHEMES = ("none", "fp16", "powersgd:rank=4", "onebit", "topk:ratio=0.001")
CHECK_COLUMNS = [
    Column("model", field("model")), Column("system", field("system")),
    Column("scheme", lambda r: f"`{r['scheme']}`"),
    Column("link", field("link")), Column("measured s", field("measured_s", "{:.3f}")),
    Column("predicted s", optional_field("predicted_s", "{:.3f}")),
    Column("error", lambda r: "not checked: route not recorded" if r["error"] is None else
           f"{r['error'] * 100:+.1f}%" + (" (fitted)" if r["fitted_here"] else "")),
    Column("MB sent/host measured", field("measured_mb", "{:.2f}")),
    Column("predicted", optional_field("predicted_mb", "{:.2f}"))]
TABLE_COLUMNS = [
    Column("Gbit/s", field("rate_gbit", "{:g}")), Column("GPUs", field("gpus")),
    Column("fastest", lambda r: f"`{r['best']}`"), Column("step s", field("best_s", "{:.3f}")),
    Column("fastest dense", lambda r: f"`{r['dense']}`"),
    Column("dense s", field("dense_s", "{:.3f}")),
    Column("speedup", field("speedup", "{:.2f}x"))]


def add_parser(commands: Any) -> None:
    """The ``model`` subcommand's options (on ``bench``'s subparsers)."""
    p = commands.add_parser("model", help="predicted step time from the cost model; "
                            "--check a bench cluster run against it; --table for 8-1024 GPUs")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", default="gpt-1.3b",
                      help="gpt-1.3b or a bench cluster model (default gpt-1.3b)")
    what.add_argument("--params", type=float, help="a GPT-style model of this many parameters")
    what.add_argument("--plan", type=Path, help="a saved per-tensor plan: JSON {name: shape}")
    p.add_argument("--hosts", type=int, default=4, help="hosts W (default 4)")
    p.add_argument("--per-host", type=int, default=8, help="GPUs per host L (default 8)")
    p.add_argument("--rate-gbit", type=float, default=10.0,
                   help="each host's link, Gbit/s each way (default 10)")
    p.add_argument("--latency-us", type=float, default=5.0,
                   help="one-way latency per hop between hosts, microseconds (default 5)")
    p.add_argument("--intra-gbit", type=float, default=0.0,
                   help="link between the GPUs of a host, Gbit/s (default 0: unlimited)")
    p.add_argument("--host-shm", action=argparse.BooleanOptionalAction,
                   help="two-level's in-host stage through shared memory (no cycle; "
                        "memory passes on the cores that compute, not --intra-gbit); with "
                        "--check the default is what the run recorded (a row's in_host, or "
                        "an older row's 'peers host' wait), else off")
    p.add_argument("--intra-latency-us", type=float, default=0.0,
                   help="one-way latency per hop between the GPUs of a host, microseconds "
                        "(two-level PowerSGD's in-host collectives; default 0)")
    p.add_argument("--scheme", default="none", help="a Compression.parse spec (default none)")
    p.add_argument("--two-level", action="store_true",
                   help="hierarchy='host': the scheme's two-level route (PowerSGD: its "
                        "factors summed in two levels; others: dense inside a host, "
                        "compressed across hosts)")
    p.add_argument("--route", choices=ROUTES, default="native",
                   help="sparse rounds by all-gather (native, allgather) or a server (ps)")
    p.add_argument("--shards", type=int, default=1, help="server shards (default 1)")
    p.add_argument("--server-mode", choices=SERVER_MODES, default="union")
    p.add_argument("--fp16-ring", action="store_true",
                   help="with --scheme none: float16 in a ring all-reduce (stock fp16)")
    p.add_argument("--compute-s", type=float, default=0.0,
                   help="forward, backward and update seconds per step (default 0)")
    p.add_argument("--cycle-ms", type=float, default=0.0,
                   help="fixed cost per collective, ms (Horovod's cycle; default 0)")
    p.add_argument("--server-round-ms", type=float, default=0.0,
                   help="fixed ms of each server round of a tensor beyond its bytes and hops "
                        "(its calls' handling; a server round waits for no Horovod cycle; "
                        "default 0)")
    p.add_argument("--codec-gbps", type=float,
                   help="codec throughput, GB/s of float32 in per rank (default: measured "
                        "on this CPU with one thread)")
    p.add_argument("--copy-gbps", type=float,
                   help="memory copy GB/s for the pipeline's passes (default: measured)")
    p.add_argument("--codec-scale", type=float, default=1.0,
                   help="factor on measured codec seconds (ranks per core; default 1)")
    p.add_argument("--check", type=Path, metavar="CLUSTER_JSON",
                   help="predict every row of a bench cluster run and fit the emulated "
                        "cluster's terms (docs/scale-model.md)")
    p.add_argument("--overhead", type=Path,
                   help="with --check: a bench overhead run (its compute floor, and DDP's "
                        "hook against our PowerSGD); default docs/results/overhead")
    p.add_argument("--cores", type=int, default=2,
                   help="with --check: the cores the emulated hosts shared (default 2): "
                        "the floor's and codecs' contention, and how much of a server "
                        "round's transfer runs while ranks compute")
    p.add_argument("--no-fit", action="store_true",
                   help="with --check: no fitted terms (codec seconds times the cores' "
                        "contention, nothing else): what the plain model predicts")
    p.add_argument("--profiles", type=Path,
                   help="codec measurements: read from this JSON if it exists (no "
                        "measuring for the routes it holds), and written back with any "
                        "measured now")
    p.add_argument("--fitted", type=Path, metavar="CHECK_JSON",
                   help="with --check: take the fitted terms from an earlier --check JSON "
                        "instead of fitting (to predict another run out of sample)")
    p.add_argument("--fit", nargs="+", default=(), metavar="TERM",
                   choices=[name for name, *_ in FITS],
                   help="with --check and --fitted: fit these terms on this run's rows "
                        "all the same (e.g. server_round_s, whose row a fit run without a "
                        "server lacks)")
    p.add_argument("--overlap", action="store_true",
                   help="the hosts' CPU per byte overlaps the wire (default: adds to it)")
    p.add_argument("--table", action="store_true",
                   help="every scheme, flat and two-level, at --gpus x --rates")
    p.add_argument("--gpus", default="8,16,32,64,128,256,512,1024")
    p.add_argument("--rates", default="10,25,100", help="Gbit/s, comma-separated")
    p.add_argument("--schemes", default=",".join(TABLE_SCHEMES).replace(",", ";"),
                   help="scheme specs, ';'-separated")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--markdown", type=Path, help="write the tables as Markdown here")


def _tensors(args: Any) -> dict[str, tuple[int, ...]]:
    if args.plan is not None:
        return load_plan(args.plan)
    if args.params is not None:
        return gpt_tensors(args.params)
    return model_tensors(args.model)


def _base(args: Any, measure_copy: bool = True) -> Cluster:
    copy = args.copy_gbps * 1e9 if args.copy_gbps else None
    if copy is None:
        copy = copy_throughput() if measure_copy else Cluster.copy_bytes_per_s
    return Cluster(hosts=args.hosts, per_host=args.per_host, rate_bits=args.rate_gbit * 1e9,
                   latency_s=args.latency_us * 1e-6, intra_bits=args.intra_gbit * 1e9,
                   intra_latency_s=args.intra_latency_us * 1e-6,
                   intra_shm=bool(args.host_shm),
                   cycle_s=args.cycle_ms / 1e3, server_round_s=args.server_round_ms / 1e3,
                   codec_scale=args.codec_scale,
                   codec_bytes_per_s=args.codec_gbps * 1e9 if args.codec_gbps else None,
                   copy_bytes_per_s=copy, compute_s=args.compute_s, overlap=args.overlap)


def _write(args: Any, payload: Any, markdown: str) -> None:
    print(markdown)
    if args.json is not None:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.markdown is not None:
        args.markdown.write_text(markdown + "\n")
        print(f"wrote {args.markdown}")


def _fitted_terms(path: Path) -> dict[str, float]:
    """The :data:`FITS` terms of an earlier ``--check`` JSON (its first model's)."""
    params = json.loads(Path(path).read_text()).get("parameters") or {}
    if not params:
        raise SystemExit(f"--fitted {path}: no fitted parameters in it (a --check JSON?)")
    first = next(iter(params.values()))
    return {name: float(first[name]) for name, *_ in FITS if name in first}


def pass_throughput(one_rank: Mapping[str, Any]) -> float:
    """Bytes per second of the pipeline's passes, from a ``bench overhead`` row: our
    PowerSGD's ``feedback`` seconds are error feedback's ``g + e`` over (nearly) every
    float32 gradient. Not its ``commit``: that holds PowerSGD's two products, which the
    measured codec counts (:func:`profile`)."""
    return 4 * one_rank["parameters"] / one_rank["ours_phases_s"]["feedback"]


def ran_shm(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a ``bench cluster`` run's two-level rows met inside their hosts through
    shared memory: a row's ``in_host`` says so, or (rows from before it was recorded) a
    dense host sum's ``peers host`` wait, which the pipeline records only there
    (:meth:`hvd_compress.hierarchy.HierarchicalPipeline.wait`). The route is the same for
    every row of a run (``$HVD_COMPRESS_HOST_SHM``)."""
    return any(r.get("in_host") == "shm" or f"peers {HOST_ROUND}" in (r.get("exchange_s") or {})
               for r in rows)


def _run_check(args: Any) -> int:
    rows = json.loads(args.check.read_text())
    shm = ran_shm(rows) if args.host_shm is None else args.host_shm
    overhead = args.overhead or Path("docs/results/overhead/overhead.json")
    one_rank = {o["model"]: o for o in json.loads(overhead.read_text())}
    models = {r["model"] for r in rows if "step_s" in r and r.get("system") != "floor"}
    missing = sorted(m for m in models if m not in one_rank)
    if missing:
        raise SystemExit(f"--overhead {overhead} has no row for {', '.join(missing)}: the "
                         "compute floor comes from it")
    given = _fitted_terms(args.fitted) if args.fitted else {}
    out = []
    fitted: dict[str, Any] = {}
    for name in sorted(models):
        o = one_rank[name]
        ranks = max(int(r["ranks"]) for r in rows if r.get("model") == name)
        contention = max(ranks / args.cores, 1.0)
        base = dataclasses.replace(
            _base(args, measure_copy=False), header_share=TCP_HEADER_SHARE, copy_bytes_per_s=(
                args.copy_gbps * 1e9 if args.copy_gbps else pass_throughput(o)),
            compute_s=o["step_s"]["floor"] * contention, latency_s=0.0, intra_shm=shm,
            cores=args.cores,
            **{"codec_scale": contention, **given})
        mine = [r for r in rows if r.get("model") == name]
        hook_s = o["hook_wall_s"] * contention
        checked, used = check(mine, base, hook_s, fitted=not (args.no_fit or given),
                              refit=args.fit if given else ())
        out += checked
        fitted[name] = {**dataclasses.asdict(used), "contention": contention,
                        "ddp_hook_s": hook_s}
    checked = [r for r in out if r["error"] is not None]
    worst = max((abs(r["error"]) for r in checked), default=0.0)
    within = sum(abs(r["error"]) <= 0.2 for r in checked)
    skipped = len(out) - len(checked)
    present = {(r.get("system"), r.get("scheme"), r.get("link")) for r in rows}
    fits = [] if args.no_fit else [list(f) for f in FITS if (not given or f[0] in args.fit)
                                   and tuple(f[1:]) in present]
    named = ", ".join(f"{n} on {s} {sc} {lk}" for n, s, sc, lk in fits) or "nothing"
    unchecked = f" ({skipped} not checked: route not recorded)" if skipped else ""
    inside = ""
    if any(r.get("split") for r in out):  # two-level rows: say how their in-host stage was priced
        how = "the run's" if args.host_shm is None else "--host-shm"
        inside = (f"; in-host stage: shared memory ({how})" if shm else
                  f"; in-host stage: {args.intra_gbit:g} Gbit/s" if args.intra_gbit else
                  "; in-host stage: free (no --intra-gbit)")
    text = "\n".join([markdown_table(out, CHECK_COLUMNS), "",
                      f"{within} of {len(checked)} rows within 20% (worst {worst * 100:.1f}%)"
                      f"{unchecked}; fitted: {named}{inside}"])
    _write(args, {"rows": out, "parameters": fitted, "fits": fits,
                  "source": str(args.check)}, text)
    return 0


def _run_table(args: Any) -> int:
    tensors = _tensors(args)
    base = _base(args)
    gpus = [int(g) for g in args.gpus.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    schemes = [s for s in args.schemes.split(";") if s]
    rows = table(tensors, schemes, gpus, rates, base,
                 progress=lambda text: print(text, file=sys.stderr, flush=True))
    best = winners(rows)
    numel = sum(math.prod(s) for s in tensors.values())
    compressed = [spec for spec in schemes if spec != "none"]
    stops = {spec: {g: crossover(tensors, ["none", spec], g, base) for g in gpus}
             for spec in compressed}
    header = "| scheme | " + " | ".join(f"{g} GPUs" for g in gpus) + " |"
    lines = [header, "|---" * (len(gpus) + 1) + "|"]
    for spec, at in stops.items():
        lines.append(f"| `{spec}` | " + " | ".join(
            "pays up to 1e5" if rate is None else "never" if rate == 0 else f"{rate:.0f}"
            for rate in at.values()) + " |")
    text = "\n".join([f"{numel / 1e9:.2f} B parameters, {base.per_host} GPUs per host",
                      "", markdown_table(best, TABLE_COLUMNS), "",
                      "Host link rate (Gbit/s) above which each scheme's fastest "
                      "configuration loses to the fastest dense one:", "", *lines])
    _write(args, {"rows": rows, "winners": best, "cluster": dataclasses.asdict(base),
                  "parameters": numel, "compression_stops_paying_gbit": stops}, text)
    return 0


def _finish(args: Any, code: int) -> int:
    if args.profiles is not None:
        save_profiles(args.profiles)
    return code


def main(args: Any) -> int:
    """``python -m hvd_compress.bench model``: one prediction, ``--check`` or ``--table``."""
    torch.set_num_threads(1)  # one thread per rank, as the emulated cluster's ranks run
    if args.profiles is not None and args.profiles.exists():
        print(f"{load_profiles(args.profiles)} codec measurements from {args.profiles}",
              file=sys.stderr)
    try:
        if args.check is not None:
            return _finish(args, _run_check(args))
        if args.table:
            return _finish(args, _run_table(args))
        job = Job(_tensors(args), args.scheme, args.two_level, args.route, args.shards,
                  args.server_mode, element_bytes=2 if args.fp16_ring else 4)
        pred = predict_job(job, _base(args))
    except ValueError as err:
        raise SystemExit(f"model: {err}") from None
    row = pred.row()
    print(json.dumps({k: v for k, v in row.items() if k != "routes"}, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(row, indent=2) + "\n")
    return 0
