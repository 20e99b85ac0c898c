"""A tensor's rounds on one shard: its state, the sum of a round's pushes and its aggregate.

Per tensor, the shard keeps one open round ``r`` and the pushes received for it: a push
of pairs ``(i_j, v_j)`` from worker ``w`` is decoded and checked, then held. When all
``W`` workers have pushed, the round closes and its pushes are summed into
``a = sum_w v_w`` on ``U``, the union of the pushed indices, in one merge over the sorted
pushes (float32, added in worker order, so the result does not depend on arrival order):

* mode ``union``: the aggregate is ``{(i, a[i]) : i in U}``, the exact sum;
* mode ``topk``: with the dense server residual ``e``, ``s = a + e``; the aggregate is the ``k``
  entries of largest ``|s_i|`` (``k`` = the most pairs any worker pushed this round; of
  equal ``|s_i|``, the lower indices first) and ``e <- s`` with those entries zeroed
  (error feedback on the server). A non-finite ``s`` is returned whole and ``e`` is kept,
  so workers detect it and skip the step.
* mode ``gtopk`` (global top-k, no server residual): the aggregate is the ``k`` entries of
  ``a`` of largest ``|a_i|`` (``k`` and ties as in ``topk``), sent as a
  :attr:`~hvd_compress.sparse_wire.Kind.SELECTED` frame. Each worker keeps the pairs it
  pushed at indices the aggregate leaves out in its own error-feedback residual
  (:meth:`~hvd_compress.comm.ps_transport.base.PendingRound.unselected`), so no gradient
  mass is lost and the server holds no state between rounds; a pull carries ``k`` pairs
  whatever ``W``, as in ``topk``, and the round's work follows the pushed pairs, as in
  ``union``. A non-finite ``a`` is returned whole.

The sum, the top-k and the aggregate frame run natively when the library is available
(:mod:`hvd_compress.native.round`: one call per round, no Python work per pair), else in
numpy here; both give the same bits (``docs/parameter-server.md#the-native-round``).

With a quorum (:class:`Quorum`, ``--quorum K --grace G``), a round also closes once
``K <= W`` workers have pushed and ``G`` seconds have passed since it opened; its
aggregate is the sum of those ``K`` pushes, and the workers who pushed are its
*contributors* (an aggregate frame says how many workers it misses in its worker field,
:func:`hvd_compress.ps_protocol.quorum_sender`). A later push for that round is *late*
(:class:`~ps_server.errors.LateRound`, status ``OUT_OF_RANGE``) and not summed: its
worker keeps those pairs in its error-feedback residual and sends them in a later round,
and pulls the closed round's aggregate like everyone else, so every replica applies the
same sums and no gradient mass is lost. The last ``Quorum.keep`` closed rounds stay
available to late pulls. The refusal names the open round
(:func:`~hvd_compress.ps_protocol.late_detail`): the late worker only pulls the rounds
before it and may skip computing their gradients
(:func:`hvd_compress.comm.parameter_server.skip_behind`).

Round ``r + 1`` then opens. The last finished round's aggregate stays available to pulls.
A retransmitted push (same worker, round and content, told apart by the frame's CRC) is
a no-op; a second push with *different* content for the same (worker, round) is a
conflict (:class:`~ps_server.errors.ConflictingPush`): the open round fails with an error
naming the worker and both peers, so no worker applies a sum with one content or the
other. Rounds before the last finished one are stale, rounds after the open one are in
the future: both are rejected. The first push or pull of a round starts its deadline; a
round still missing workers when it passes fails with an error naming them, and the next
round opens. The first push of an unknown tensor fixes its round and size.

:class:`~ps_server.store.ShardStore` runs this state machine for every tensor of a shard;
see ``docs/parameter-server.md`` for the protocol.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvd_compress.native import available as native_available
from hvd_compress.native import round as native_round
from hvd_compress.native import sparse as native_sparse
from hvd_compress.sparse_wire import (
    Frame,
    IndexCoding,
    Kind,
    ValueDType,
    bitmap_nbytes,
    encode_frame,
    pack_header,
)

MODES = ("union", "topk", "gtopk")
AGGREGATE_KINDS = {"union": Kind.AGGREGATE, "topk": Kind.AGGREGATE, "gtopk": Kind.SELECTED}
"""The kind of frame each mode answers a pull with."""


@dataclass(frozen=True)
class Quorum:
    """When a round may close without every worker: once ``size`` of the ``workers`` have
    pushed and ``grace`` seconds have passed since it opened (its first push or pull).
    ``keep``: closed rounds whose aggregates stay available to late workers' pulls (a
    worker that falls further behind gets ``StaleRound``). ``size == workers`` (the
    default) waits for everyone, as without a quorum.

    Advice: a grace of about one step time lets a worker that is only a little late still
    contribute; see docs/reliability.md#stragglers for measured step times.
    """

    workers: int
    size: int
    grace: float = 0.0
    keep: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.size <= self.workers:
            raise ValueError(f"quorum must be between 1 and the {self.workers} workers, "
                             f"got {self.size}")
        if self.grace < 0:
            raise ValueError(f"grace must be >= 0 seconds, got {self.grace:g}")
        if self.keep < 1:
            raise ValueError(f"the closed rounds kept for late workers must be >= 1, "
                             f"got {self.keep}")

    @classmethod
    def parse(cls, spec: str | float | None, workers: int, grace: float = 0.0,
              keep: int = 64) -> Quorum:
        """``spec`` as ``--quorum`` takes it: a count of workers (``"3"``), a fraction of
        them (``"0.75"``: ``ceil(0.75 W)``), or None for all ``workers``."""
        if spec is None:
            return cls(workers, workers, grace, keep)
        text = str(spec).strip()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        fraction = "." in text
        if not (0 < value <= 1 if fraction else value >= 1 and value == int(value)):
            raise ValueError(f"--quorum must be a number of workers (3) or a fraction of "
                             f"them in (0, 1] (0.75), got {spec!r}")
        size = max(1, math.ceil(value * workers - 1e-9)) if fraction else int(value)
        return cls(workers, size, grace, keep)

    @property
    def partial(self) -> bool:
        """Whether a round may close without every worker."""
        return self.size < self.workers

    def closes(self, pushed: int, opened: float | None, now: float) -> bool:
        """Whether an open round with ``pushed`` pushes, opened at ``opened``, closes now."""
        if pushed >= self.workers:
            return True
        return pushed >= self.size and opened is not None and now - opened >= self.grace


@dataclass
class Finished:
    """The outcome of a finished round: pairs, or the error that failed it.
    ``contributors``: the workers whose pushes it sums (sorted); ``digests``: their
    pushes' (CRC, peer), to tell a retransmission from a conflict."""

    round: int
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    error: str | None = None
    encoded: dict[ValueDType, bytes] = field(default_factory=dict)
    durable: bool = True  # False until the journal holds it; pulls wait until then
    contributors: tuple[int, ...] = ()
    digests: dict[int, tuple[int, str]] = field(default_factory=dict)


@dataclass
class TensorState:
    """One tensor's shard: its open ``round`` and that round's pushes (with their content
    digests and peers), the last finished round, the top-k residual and the time of its
    last use."""

    numel: int
    round: int
    pushed: dict[int, Frame] = field(default_factory=dict)  # this round's, by worker
    digests: dict[int, tuple[int, str]] = field(default_factory=dict)  # (CRC, peer)
    last_digests: dict[int, tuple[int, str]] = field(default_factory=dict)
    opened: float | None = None
    residual: np.ndarray | None = None
    last: Finished | None = None
    touched: float = 0.0
    history: dict[int, Finished] = field(default_factory=dict)  # closed rounds, by round

    def finished(self, round: int) -> Finished | None:
        """The finished round ``round`` if it is the last one or still kept; else None."""
        if self.last is not None and self.last.round == round:
            return self.last
        return self.history.get(round)

    def nbytes(self) -> int:
        """Bytes of arrays this tensor holds (pushes, residual, last aggregate)."""
        held = sum(f.indices.nbytes + f.values.nbytes for f in self.pushed.values())
        if self.residual is not None:
            held += self.residual.nbytes
        kept = {id(f): f for f in (self.last, *self.history.values()) if f is not None}
        for f in kept.values():
            if f.indices is not None:
                held += f.indices.nbytes + f.values.nbytes
            held += sum(len(b) for b in f.encoded.values())
        return held


def new_state(mode: str, numel: int, round: int, now: float) -> TensorState:
    """A tensor first seen at ``round`` (with a zero residual in mode ``topk``)."""
    state = TensorState(numel=numel, round=round, touched=now)
    if mode == "topk":
        state.residual = np.zeros(numel, dtype=np.float32)
    return state


def close_pushes(mode: str, state: TensorState, pushes: list[Frame], k: int
                 ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """A closing round's union sum of ``pushes`` (:func:`sum_pushes`) and its aggregate
    (:func:`aggregate`, updating ``state``'s residual): natively in one call when the
    library is available, else in numpy (the same bits)."""
    native = native_round.close_round([(f.indices, f.values) for f in pushes], state.numel,
                                      state.residual if mode == "topk" else None, k)
    if native is not None:
        union, result = native
        return union, aggregate(mode, state, *union, k) if mode == "gtopk" else result
    indices, values = sum_pushes(pushes, state.numel)
    return (indices, values), aggregate(mode, state, indices, values, k)


def encode_aggregate(tensor: str, shard: int, shards: int, finished: Finished, sender: int,
                     numel: int, dtype: ValueDType, kind: Kind = Kind.AGGREGATE) -> bytes:
    """The aggregate frame of ``finished`` in ``dtype`` (what :func:`encode_frame` gives),
    written in one native pass for float32 values when the library is available; ``kind``:
    the mode's (:data:`AGGREGATE_KINDS`)."""
    idx, val = finished.indices, finished.values
    if dtype is ValueDType.FP32 and native_available():
        name = tensor.encode("utf-8")
        count = int(idx.size)
        # the varint section written once (its size is the section's), unless a bitmap
        # is surely smaller (a varint takes a byte at least)
        section = native_round.varint_section(idx) if count < bitmap_nbytes(numel) else None
        sizes = {IndexCoding.VARINT: (section.size if section is not None else
                                      native_sparse.varint_index_nbytes(idx)) + 4 * count,
                 IndexCoding.BITMAP: bitmap_nbytes(numel) + 4 * count,
                 IndexCoding.DENSE: 4 * numel}
        coding = min(sizes, key=lambda c: (sizes[c], c))
        values = numel if coding is IndexCoding.DENSE else count
        head = pack_header(kind, coding, dtype, sender, finished.round, shard,
                           shards, numel, values, sizes[coding] - 4 * values, name)
        size = len(head) + sizes[coding] + 4
        encoded = native_round.assemble_frame(head, section, val, size) \
            if coding is IndexCoding.VARINT and section is not None else \
            native_round.encode_frame(head, idx, val, numel, int(coding), size)
        if encoded is not None:
            return encoded
    return encode_frame(kind, tensor, shard, shards, finished.round, sender, numel,
                        idx, val, dtype)


def sum_pushes(pushes: list[Frame], numel: int) -> tuple[np.ndarray, np.ndarray]:
    """The union of the pushes' indices (increasing, int64) and the float32 sums there,
    added in the order of ``pushes``."""
    pairs = [(f.indices, f.values) for f in pushes]
    merged = native_sparse.merge_sum(pairs)
    if merged is not None:
        return merged
    acc = np.zeros(numel, dtype=np.float32)
    for indices, values in pairs:
        acc[indices] += values  # indices are unique within a frame
    union = np.unique(np.concatenate([indices for indices, _ in pairs]))
    return union, acc[union]


def aggregate(mode: str, state: TensorState, indices: np.ndarray, values: np.ndarray,
              k: int) -> tuple[np.ndarray, np.ndarray]:
    """The round's aggregate from its union sum (updating ``state``'s top-k residual);
    see the module docstring for each mode."""
    if mode == "topk":
        native = native_round.topk(state.residual, indices, values, k)
        if native is not None:
            return native
        total = state.residual.copy()
        total[indices] += values
        if np.isfinite(total).all():
            indices = _largest(np.abs(total), min(k, state.numel))
            values = total[indices]
            total[indices] = 0.0
            state.residual = total
        else:
            indices = np.arange(state.numel)
            values = total
    elif mode == "gtopk":
        native = native_round.select_largest(indices, values, k)
        if native is not None:
            return native
        if np.isfinite(values).all():
            chosen = _largest(np.abs(values), min(k, values.size))
            indices, values = indices[chosen], values[chosen]
    return indices.astype(np.int64, copy=False), values.astype(np.float32, copy=False)


def _largest(magnitude: np.ndarray, k: int) -> np.ndarray:
    """The increasing indices of the ``k`` largest entries, of equal ones the lowest."""
    if k <= 0:
        return np.zeros(0, np.int64)
    kth = np.partition(magnitude, magnitude.size - k)[magnitude.size - k]
    above = np.flatnonzero(magnitude > kth)
    ties = np.flatnonzero(magnitude == kth)[:k - above.size]
    return np.union1d(above, ties).astype(np.int64, copy=False)


def release_memory() -> None:
    """Give freed heap memory back to the operating system (glibc's ``malloc_trim``; a
    no-op elsewhere). Arrays of a few KB come from the heap, which otherwise keeps the
    pages of expired tensors."""
    if _libc is not None:
        _libc.malloc_trim(0)


class HeapKeeper:
    """Lets this process's heap keep the pages its rounds' replies take, so that the next
    round does not fault them in again (glibc's ``mallopt``; a no-op elsewhere).

    Each pull of a closed round is answered with the round's aggregate frame, and gRPC
    copies it once per pull into memory of its own; the pushes' bytes come the same way.
    By default glibc gives the top of its heap back once those are freed (beyond its trim
    threshold, about twice the largest block it freed from ``mmap``), so every round faults
    the same pages in again. Here, once a reply of :data:`MIN_REPLY` bytes or more was
    encoded, blocks below :data:`MMAP_THRESHOLD` come from the heap, and the heap keeps up
    to ``2 * pulls * sum(last reply of each tensor)`` free bytes (a step's replies and as
    much again for its pushes), at most :data:`TRIM_MAX`.

    Only rounds raise the thresholds, that is pushes that passed authentication and every
    check, and only to what those rounds used: the heap never grows past its own peak
    use, it only keeps it. An idle server's tensors expire and :func:`release_memory` gives
    the pages back. Faults and throughput before and after:
    docs/results/ps-heap-a797017/README.md.
    """

    MIN_REPLY = 128 << 10
    MMAP_THRESHOLD = 32 << 20
    """glibc's ``M_MMAP_THRESHOLD`` once set: the most its own adjustment goes to."""
    TRIM_MAX = 256 << 20

    def __init__(self, libc: Any = None) -> None:
        self.libc = _libc if libc is None else libc
        self.replies: dict[str, int] = {}
        self.total = 0  # sum(self.replies.values()), kept as replies come and go
        self.trim = 0

    def fit(self, tensor: str, reply_bytes: int, pulls: int) -> int:
        """Note ``tensor``'s reply of ``reply_bytes`` answering ``pulls`` pulls; the trim
        threshold now set (0 while none is)."""
        if reply_bytes < self.MIN_REPLY and not self.trim:
            return 0
        self.total += reply_bytes - self.replies.get(tensor, 0)
        self.replies[tensor] = reply_bytes
        trim = min(2 * pulls * self.total, self.TRIM_MAX)
        if trim > self.trim and self._set(trim):
            self.trim = trim
        return self.trim

    def forget(self, tensors: list[str]) -> None:
        """Expired tensors no longer count towards the threshold (it is not lowered: the
        expiry's :func:`release_memory` gives the free pages back)."""
        for name in tensors:
            self.total -= self.replies.pop(name, 0)

    def _set(self, trim: int) -> bool:
        if self.libc is None or not hasattr(self.libc, "mallopt"):
            return False
        return bool(self.libc.mallopt(_M_MMAP_THRESHOLD, self.MMAP_THRESHOLD)) and \
            bool(self.libc.mallopt(_M_TRIM_THRESHOLD, trim))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _load_libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_libc = _load_libc()
