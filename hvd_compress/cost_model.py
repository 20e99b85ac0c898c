"""The cost model: what one step's gradient exchange costs, in bytes and seconds.

One place for the arithmetic that both ``Compression.auto`` (:mod:`hvd_compress.policy`,
which measures its inputs at start-up on the job's own links) and the scale model
(``python -m hvd_compress.bench model``, :mod:`hvd_compress.bench.model`, which takes them
as parameters) predict with. Figures and the check against the emulated cluster:
docs/scale-model.md.

Bytes a rank (or a host) puts on its link, for a collective whose request holds ``b`` bytes
on each of ``p`` participants:

* ring all-reduce: ``2 (p - 1) / p * b`` (reduce-scatter, then all-gather, of ``b / p``
  chunks; :func:`ring_allreduce_bytes`);
* all-to-all: ``(p - 1) / p * b`` (:func:`alltoall_bytes`);
* all-gather and a sparse sum without a server: ``(p - 1) * b`` (every other rank's copy
  passes through; :func:`allgather_bytes`);
* parameter server: a worker sends its push and receives the pull; each of ``s`` shards'
  links carries ``w / s`` pushes in and ``w / s`` pulls out (:func:`server_bytes`).

Seconds: ``t = compute + send_bytes * seconds_per_byte`` per tensor and route
(:class:`RouteCost`), plus ``latency`` per collective the step starts (:func:`predict`;
requests of one round and kind fuse into one collective, sparse sums never do:
:func:`collectives`). The scale model adds, per collective, one hop latency per step of its
algorithm (:func:`hops`: ``2 (p - 1)`` for a ring all-reduce, ``p - 1`` for a ring
all-gather or all-to-all, 2 round trips for a server).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, nbytes

ALLREDUCE, ALLTOALL, ALLGATHER, SPARSE, SERVER = (
    "allreduce", "alltoall", "allgather", "sparse", "server")
KINDS = (ALLREDUCE, ALLTOALL, ALLGATHER, SPARSE, SERVER)


@dataclass(frozen=True)
class LinkModel:
    """What one collective costs on this job's links: ``latency`` seconds, plus
    ``seconds_per_byte`` for each byte a rank sends."""

    latency: float
    seconds_per_byte: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second one rank sends (``1 / seconds_per_byte``)."""
        return 1.0 / max(self.seconds_per_byte, 1e-15)


@dataclass(frozen=True)
class RouteCost:
    """One route's costs for one tensor: its compute seconds, the bytes it puts on this
    rank's link, the kind of each round's request (:func:`kind`) and, where measured, each
    round's request size in bytes (``payloads``, from which :func:`link_bytes` gives the
    bytes at any rank count)."""

    compute: float
    send_bytes: float
    kinds: tuple[str, ...]
    payloads: tuple[float, ...] = ()

    @property
    def rounds(self) -> int:
        return len(self.kinds)

    def seconds(self, link: LinkModel) -> float:
        return self.compute + self.send_bytes * link.seconds_per_byte


def ring_allreduce_bytes(payload: float, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``payload`` bytes."""
    return 2 * (ranks - 1) / ranks * payload


def alltoall_bytes(payload: float, ranks: int) -> float:
    """Bytes each rank sends in an all-to-all of a ``payload``-byte tensor cut in equal
    parts (its own part stays)."""
    return (ranks - 1) / ranks * payload


def allgather_bytes(payload: float, ranks: int) -> float:
    """Bytes each rank receives (and, in a ring, forwards) in an all-gather of ``payload``
    bytes from every rank."""
    return (ranks - 1) * payload


def server_bytes(push: float, pull: float, workers: int, shards: int) -> tuple[float, float]:
    """``(worker, shard)``: bytes on one worker's link (its push out, the pull in) and on
    one server shard's link (``workers / shards`` pushes in and as many pulls out)."""
    return push + pull, workers * (push + pull) / shards


def link_bytes(kind_: str, payload: float, ranks: int) -> float:
    """Bytes one participant puts on its link for a request of ``kind_`` holding
    ``payload`` bytes, among ``ranks`` participants (``server``: the worker's push and a
    pull of the same size)."""
    if kind_ == ALLREDUCE:
        return ring_allreduce_bytes(payload, ranks)
    if kind_ == ALLTOALL:
        return alltoall_bytes(payload, ranks)
    if kind_ in (ALLGATHER, SPARSE):
        return allgather_bytes(payload, ranks)
    if kind_ == SERVER:
        return server_bytes(payload, payload, ranks, 1)[0]
    raise ValueError(f"unknown collective kind {kind_!r}; choose from {', '.join(KINDS)}")


def hops(kind_: str, ranks: int) -> int:
    """Steps one after the other (each paying the link's one-way latency) of a collective
    of ``kind_`` among ``ranks``: a ring all-reduce ``2 (p - 1)``, a ring all-gather or
    all-to-all ``p - 1``, a server push and pull 4 (two round trips)."""
    if ranks <= 1:
        return 0
    if kind_ == ALLREDUCE:
        return 2 * (ranks - 1)
    if kind_ == SERVER:
        return 4
    return ranks - 1


def send_bytes(op: Collective, size: int) -> float:
    """Bytes this rank puts on its link for ``op`` among ``size`` ranks (module docstring)."""
    return link_bytes(kind(op), nbytes(op), size)


def kind(op: Collective) -> str:
    """``allreduce``, ``alltoall``, ``allgather`` (requests of one kind and round fuse), or
    ``sparse`` (a sparse sum, or an all-gather without sizes: never fused)."""
    if isinstance(op, AllReduce):
        return ALLREDUCE
    if isinstance(op, AllToAll):
        return ALLTOALL
    if isinstance(op, AllGather) and op.sizes is not None:
        return ALLGATHER
    return SPARSE


def step_collectives(costs: Mapping[str, Mapping[str, RouteCost]],
                     routes: Mapping[str, str]) -> list[str]:
    """The kind of every collective a step of these routes starts: one per distinct
    (round, kind) of fusable requests, one per tensor and round of sparse ones (a server's
    pushes and pulls, and all-gathers without sizes, never fuse)."""
    fused: dict[tuple[int, str], str] = {}
    alone: list[str] = []
    for name, route in routes.items():
        for i, what in enumerate(costs[name][route].kinds):
            if what in (SPARSE, SERVER):
                alone.append(what)
            else:
                fused[(i, what)] = what
    return list(fused.values()) + alone


def step_cycles(costs: Mapping[str, Mapping[str, RouteCost]], routes: Mapping[str, str],
                cycled: Collection[str] = KINDS) -> int:
    """Negotiation cycles a step of these routes takes: one per distinct (round, kind),
    sparse all-gathers included (the requests of one round and kind are ready together and
    Horovod's background loop starts them all in one cycle, fused or not: measured in
    ``docs/results/model/check-cycles-915bfdb``). Only kinds in ``cycled`` go through
    Horovod: with ``collectives="gloo"`` every collective runs on a Gloo group (top-k's
    sums as frames in slots of a size every rank knows). Server rounds wait for no cycle:
    a worker pushes and pulls on its own (at a 100 ms cycle, top-k through the server on a
    Gloo group took as long as at 10 ms: docs/results/server-cycle-61efecc)."""
    cycles: set[tuple[int, str]] = set()
    for name, route in routes.items():
        for i, what in enumerate(costs[name][route].kinds):
            if what != SERVER and what in cycled:
                cycles.add((i, what))
    return len(cycles)


def collectives(costs: Mapping[str, Mapping[str, RouteCost]], routes: Mapping[str, str]) -> int:
    """Collectives a step of these routes starts (:func:`step_collectives`)."""
    return len(step_collectives(costs, routes))


def predict(costs: Mapping[str, Mapping[str, RouteCost]], routes: Mapping[str, str],
            link: LinkModel) -> float:
    """Predicted exchange seconds per step: every tensor's route cost, plus one latency per
    collective the step starts (:func:`collectives`)."""
    return sum(costs[n][r].seconds(link) for n, r in routes.items()) + \
        link.latency * collectives(costs, routes)
