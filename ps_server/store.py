"""The round state machine and shard store: no I/O, safe to call from many threads.

Per tensor, the shard keeps one open round ``r`` and the pushes received for it: a push
of pairs ``(i_j, v_j)`` from worker ``w`` is decoded and checked, then held. When all
``W`` workers have pushed, the round closes and its pushes are summed into
``a = sum_w v_w`` on ``U``, the union of the pushed indices, in one merge over the sorted
pushes (float32, added in worker order, so the result does not depend on arrival order):

* mode ``union``: the aggregate is ``{(i, a[i]) : i in U}``, the exact sum;
* mode ``topk``: with the dense server residual ``e``, ``s = a + e``; the aggregate is the ``k``
  entries of largest ``|s_i|`` (``k`` = the most pairs any worker pushed this round) and
  ``e <- s`` with those entries zeroed (error feedback on the server). A non-finite ``s``
  is returned whole and ``e`` is kept, so workers detect it and skip the step.

Round ``r + 1`` then opens. The last finished round's aggregate stays available to pulls.
A retransmitted push (same worker, round and content, told apart by the frame's CRC) is
a no-op; a second push with *different* content for the same (worker, round) is a
conflict: two ranks share a worker id, or a token holder pushed as another worker. The
open round then fails with an error naming the worker and both peers, which the second
sender gets at once (``ALREADY_EXISTS``) and every puller of the round gets as its error,
so no worker applies a sum with one content or the other. Rounds before the last
finished one are stale, rounds after the open one are in the future: both are rejected.
The first push or pull of a round starts its deadline; a round still missing workers when
it passes fails with an error naming them, and the next round opens. The first push of
an unknown tensor fixes its round and size.

Durability (``durable=True``, when the server keeps checkpoints): a finished round is
queued as a change record (:meth:`ShardStore.take_changes`) and its aggregate is held
back from pulls until the journal writer has written that record and called
:meth:`ShardStore.mark_durable`. So any aggregate a worker has seen survives a crash of
the server, and after a restart the server is at, or past, the round of every worker:
the workers resume in agreement. Change records hold the round's *union sum* (not the
top-k aggregate) so that :meth:`ShardStore.replay` recomputes the same aggregate and
server residual through the same code as the live close.

Worker identity (:meth:`ShardStore.claim`): every gRPC client process draws a random
secret when it is made and sends it with each call
(:func:`hvd_compress.ps_protocol.identity_metadata`); the store binds each (session,
worker) to the first secret it sees (keeping a digest of it, the first peer and the time)
and refuses any later call for that worker of that session with another secret, or with
none, as :class:`WorkerBound` (``PERMISSION_DENIED``), naming the first peer. The gRPC
transport asks :meth:`ShardStore.bound_elsewhere` before the request's body is read, so
an impersonating push is refused unread and never reaches a round; the content check
above stays for clients that send no identity. Why a per-process secret, not a key
derived from the token: every worker holds the same token, so any token holder could
derive any worker's key; what tells two processes apart is something only one of them
has. Why not the first connection: a client reconnects (new port, new connection) after
a network blip or a server restart and must stay the same worker, which the secret does
since it lives as long as the client. A process that replaces a dead one (a new secret)
is refused until the session expires; jobs start a new session per run anyway.

Bindings are state like rounds: with ``durable`` a new binding is queued as a change
record ahead of any round its worker's pushes close, so a round a worker has seen is
never on disk without the bindings of those who pushed it, and a restarted server keeps
refusing the same impersonator. A binding not yet written when the server died belonged
to rounds nobody saw, and is learned again from the first call after the restart.

Idle expiry (``idle_timeout`` seconds, checked by :meth:`ShardStore.expire`): a tensor
neither pushed nor pulled for that long is dropped with its residual, last aggregate and
pending pushes, and one INFO line per session (the tensor name's part before ``/``) says
how many tensors and bytes were freed. A session's bindings go with it: a binding whose
session has no tensor left and whose worker made no call for ``idle_timeout`` is freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from hvd_compress.native import sparse as native_sparse
from hvd_compress.ps_protocol import session_of
from hvd_compress.sparse_wire import (
    SERVER_ID,
    Frame,
    Kind,
    ValueDType,
    encode_frame,
)

MODES = ("union", "topk")
log = logging.getLogger("ps_server")


class RequestError(Exception):
    """A request the server refuses; ``code`` is the gRPC status name it maps to."""

    code = "INVALID_ARGUMENT"


class StaleRound(RequestError):
    code = "FAILED_PRECONDITION"


class FutureRound(RequestError):
    code = "FAILED_PRECONDITION"


class RoundFailed(RequestError):
    code = "ABORTED"


class UnknownTensor(RequestError):
    code = "NOT_FOUND"


class PullTimeout(RequestError):
    code = "DEADLINE_EXCEEDED"


class ConflictingPush(RequestError):
    """A second push with different content for the same (worker, round)."""

    code = "ALREADY_EXISTS"


class OverBudget(RequestError):
    """Accepting the push would make the open rounds' pushes exceed the memory budget."""

    code = "RESOURCE_EXHAUSTED"


class WorkerBound(RequestError):
    """A call for a worker of a session that is bound to another process (see the
    module docstring)."""

    code = "PERMISSION_DENIED"


class NotDurable(RequestError):
    """The server cannot make rounds durable (a checkpoint write keeps failing): every
    push and pull is refused with the write's error until a write succeeds."""

    code = "UNAVAILABLE"


class JobSizeMismatch(RequestError):
    """The client's job has a different number of workers than the server's --workers."""

    code = "FAILED_PRECONDITION"


@dataclass
class Change:
    """One journal record: round ``round`` of ``tensor`` finished (``sums`` are the union
    indices and float32 sums of its pushes, ``k`` the most pairs a worker pushed), or
    failed with ``error``; or, with ``dropped``, the tensor expired."""

    tensor: str
    round: int = 0
    numel: int = 0
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    k: int = 0
    error: str | None = None
    dropped: bool = False
    binding: tuple[int, str | None, str, float] | None = None
    """A worker of session ``tensor`` bound: (worker, key as hex, first peer, first seen
    as Unix time); with key None, freed."""


@dataclass
class Binding:
    """The process a (session, worker) is bound to: ``key`` is the digest of its secret,
    ``peer`` and ``since`` (Unix time) its first call, ``touched`` (the store's clock) its
    last."""

    key: bytes
    peer: str
    since: float
    touched: float

    def record(self, worker: int) -> tuple[int, str, str, float]:
        """The :attr:`Change.binding` of this binding for ``worker``."""
        return worker, self.key.hex(), self.peer, self.since


@dataclass
class Finished:
    """The outcome of a finished round: pairs, or the error that failed it."""

    round: int
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    error: str | None = None
    encoded: dict[ValueDType, bytes] = field(default_factory=dict)
    durable: bool = True  # False until the journal holds it; pulls wait until then


@dataclass
class TensorState:
    numel: int
    round: int
    pushed: dict[int, Frame] = field(default_factory=dict)  # this round's, by worker
    digests: dict[int, tuple[int, str]] = field(default_factory=dict)  # (CRC, peer)
    last_digests: dict[int, tuple[int, str]] = field(default_factory=dict)
    opened: float | None = None
    residual: np.ndarray | None = None
    last: Finished | None = None
    touched: float = 0.0

    def nbytes(self) -> int:
        """Bytes of arrays this tensor holds (pushes, residual, last aggregate)."""
        held = sum(f.indices.nbytes + f.values.nbytes for f in self.pushed.values())
        if self.residual is not None:
            held += self.residual.nbytes
        last = self.last
        if last is not None and last.indices is not None:
            held += last.indices.nbytes + last.values.nbytes
            held += sum(len(b) for b in last.encoded.values())
        return held


class ShardStore:
    """The state of one shard of every tensor, with the round state machine above.

    Finished rounds are queued for :meth:`pop_events`, which the server drains to count
    rounds, and with ``durable`` also for :meth:`take_changes` (see the module docstring).
    ``idle_timeout`` (seconds, None for never) expires tensors nobody used for that long.
    ``push_budget`` (bytes, None for no limit) bounds the decoded pairs that the pushes of
    open rounds hold together; a push that would exceed it is refused (``OverBudget``)
    before it is held, unless it is the last of its round (the close frees them all).
    Functions in ``listeners`` are called with a tensor's name (lock held: they must only
    schedule work) whenever a pull of it may now have an answer.
    """

    def __init__(self, workers: int, shard: int, shards: int, mode: str = "union",
                 deadline: float = 120.0, max_numel: int = 1 << 28,
                 clock: Callable[[], float] = time.monotonic, durable: bool = False,
                 idle_timeout: float | None = None, push_budget: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if not 0 <= shard < shards:
            raise ValueError(f"shard must satisfy 0 <= shard < shards, got {shard}/{shards}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if deadline <= 0:
            raise ValueError(f"deadline must be positive, got {deadline}")
        if idle_timeout is not None and idle_timeout <= deadline:
            raise ValueError(f"idle timeout must exceed the round deadline ({deadline:g} s), "
                             f"got {idle_timeout:g} s")
        self.workers, self.shard, self.shards = workers, shard, shards
        self.mode, self.deadline, self.max_numel = mode, deadline, max_numel
        self.clock, self.durable, self.idle_timeout = clock, durable, idle_timeout
        self.push_budget = push_budget
        self.pending_bytes = 0  # decoded pairs held by the pushes of open rounds
        self.tensors: dict[str, TensorState] = {}
        self.bindings: dict[tuple[str, int], Binding] = {}  # (session, worker) -> process
        self.closed_rounds = 0
        self.failed_rounds = 0
        self.expired_tensors = 0
        self.events: list[tuple[str, int, str | None]] = []  # (tensor, round, error)
        self.changes: list[Change] = []  # for the journal, when durable
        self._undurable: list[tuple[str, Finished]] = []
        self.listeners: list[Callable[[str], None]] = []
        self.durable_version = 0  # counts mark_durable calls, for polling transports
        self.unavailable: str | None = None  # why rounds cannot be made durable now
        # Set by transports that call expire() at least every freeze_gap / 4 seconds: a
        # longer gap means the process was stopped (SIGSTOP, a VM pause) or starved, and
        # the pushes sent meanwhile wait unread in its sockets; deadlines then count from
        # when the server runs again, so those pushes are read before any round fails.
        self.freeze_gap: float | None = None
        self._awake = clock()
        self._cond = threading.Condition()

    # Requests ------------------------------------------------------------------------------
    def push(self, frame: Frame, digest: int | None = None, peer: str = "?") -> bool:
        """Add a worker's pairs to its round. True if accepted, False if a retransmission.

        ``digest`` identifies the content (the frame's CRC; computed from the pairs when
        not given); ``peer`` names the sender in conflict errors.
        """
        self._check(frame, Kind.PUSH)
        if digest is None:
            digest = zlib.crc32(frame.values.tobytes(), zlib.crc32(frame.indices.tobytes()))
        with self._cond:
            self._check_available()
            self._expire_locked()
            state = self.tensors.get(frame.tensor)
            if state is None:
                state = self._register(frame)
            self._check_numel(state, frame)
            state.touched = self.clock()
            r, w = frame.round, frame.worker
            if r == state.round:
                if w in state.pushed:
                    self._check_same(frame.tensor, state, r, w, digest, peer,
                                     state.digests[w], open_round=True)
                    return False
                if len(state.pushed) + 1 < self.workers:  # a closing push frees at once
                    self._check_budget(frame)
                self._add(state, frame)
                state.digests[w] = (digest, peer)
                if len(state.pushed) == self.workers:
                    self._close(frame.tensor, state)
                return True
            if state.last is not None and r == state.last.round:
                if state.last.error is not None:
                    raise RoundFailed(state.last.error)
                first = state.last_digests.get(w)
                if first is not None:
                    self._check_same(frame.tensor, state, r, w, digest, peer, first,
                                     open_round=False)
                return False  # every worker pushed round r before it closed
            raise self._out_of_order(frame, state, "push")

    def _check_same(self, tensor: str, state: TensorState, r: int, w: int, digest: int,
                    peer: str, first: tuple[int, str], open_round: bool) -> None:
        """Raise :class:`ConflictingPush` (failing the round if it is open) unless
        ``digest`` matches the content worker ``w`` pushed first."""
        if digest == first[0]:
            return
        where = f"round {r} of tensor {tensor!r} (shard {self.shard}/{self.shards})"
        error = (f"{where}: worker {w} pushed twice with different content (first from "
                 f"{first[1]}, then from {peer}): two ranks share worker id {w}, or a token "
                 "holder pushed as that worker; give each rank its own id")
        if open_round:
            error += f"; the round failed and the server continues with round {r + 1}"
            self._fail(tensor, state, error)
        else:
            error += "; the round had already closed with the first content"
        raise ConflictingPush(error)

    def bound_elsewhere(self, session: str, worker: int, key: bytes | None
                        ) -> Binding | None:
        """The binding of ``worker`` of ``session`` if it is to another process than the
        one with ``key`` (None: a call without identity), else None. Reads one entry
        without the lock, so a transport may ask before it reads a request's body."""
        binding = self.bindings.get((session, worker))
        return None if binding is None or binding.key == key else binding

    def claim(self, session: str, worker: int, key: bytes | None, peer: str) -> None:
        """Bind ``worker`` of ``session`` to the process with ``key`` if it is unbound,
        or refuse the call (:class:`WorkerBound`) if it is bound to another process or
        ``key`` is None (no identity) and it is bound at all. Ids out of range are left
        to the frame checks; calls without identity bind nothing."""
        with self._cond:
            binding = self.bindings.get((session, worker))
            if binding is None:
                if key is None or not 0 <= worker < self.workers:
                    return
                binding = Binding(key, peer, time.time(), self.clock())
                self.bindings[session, worker] = binding
                if self.durable:
                    self.changes.append(Change(session, binding=binding.record(worker)))
                log.info("worker %d of session %r bound to the process at %s", worker,
                         session, peer)
            elif binding.key == key:
                binding.touched = self.clock()
            else:
                raise WorkerBound(self.bound_error(session, worker, binding, peer,
                                                   key is None))

    def bound_error(self, session: str, worker: int, binding: Binding, peer: str,
                    anonymous: bool) -> str:
        """The refusal of a call from ``peer`` for ``worker`` of ``session``, which is
        bound to the process of ``binding``."""
        seen = datetime.fromtimestamp(binding.since, timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
        this = "carries no worker identity" if anonymous else "comes from another process"
        expiry = ("" if self.idle_timeout is None else
                  f", or this one to expire after {self.idle_timeout:g} s idle")
        return (f"worker {worker} of session {session!r} (shard {self.shard}/{self.shards}) "
                f"is bound to another process, first seen from {binding.peer} at {seen}; "
                f"this call {this} ({peer}): two ranks launched with one worker id, or "
                "another process using this worker's id? Give each rank its own worker "
                f"id; a process replacing one that died needs a new session{expiry}")

    def try_pull(self, frame: Frame) -> bytes | None:
        """The aggregate frame for ``frame.round``, or None while that round is open."""
        self._check(frame, Kind.PULL)
        with self._cond:
            self._expire_locked()
            return self._try_pull_locked(frame)

    def pull(self, frame: Frame, timeout: float) -> bytes:
        """Wait up to ``timeout`` seconds for ``frame.round`` to finish; its aggregate."""
        self._check(frame, Kind.PULL)
        give_up = self.clock() + timeout
        with self._cond:
            while True:
                self._expire_locked()
                result = self._try_pull_locked(frame)
                if result is not None:
                    return result
                now = self.clock()
                if now >= give_up:
                    raise PullTimeout(f"{frame.where()}: round still open after {timeout:g} s "
                                      "(waiting for other workers' pushes)")
                opened = self.tensors[frame.tensor].opened or now
                self._cond.wait(max(min(give_up, opened + self.deadline) - now, 0.0) + 1e-3)

    def expire(self) -> None:
        """Fail every open round whose deadline has passed; drop idle tensors."""
        with self._cond:
            self._expire_locked()
            if self.idle_timeout is not None:
                self._expire_idle_locked()

    def take_changes(self) -> tuple[list[Change], list[tuple[str, Finished]]]:
        """The change records since the last call, and the finished rounds they make
        durable once written (pass those to :meth:`mark_durable`, or to :meth:`requeue`
        when the write failed)."""
        with self._cond:
            changes, self.changes = self.changes, []
            undurable, self._undurable = self._undurable, []
            return changes, undurable

    def requeue(self, changes: list[Change], finished: list[tuple[str, Finished]]) -> None:
        """Put back what :meth:`take_changes` returned when writing it failed, ahead of
        anything queued since, so the next write holds every change in order."""
        with self._cond:
            self.changes[:0] = changes
            self._undurable[:0] = finished

    def set_unavailable(self, reason: str | None) -> None:
        """While ``reason`` is not None, refuse every push and pull with
        :class:`NotDurable` (``reason`` as its message), waking the pulls that wait;
        None serves again."""
        with self._cond:
            self.unavailable = reason
            self._cond.notify_all()
            for tensor in list(self.tensors):
                for listener in self.listeners:
                    listener(tensor)

    def mark_durable(self, finished: list[tuple[str, Finished]]) -> None:
        """The journal holds these rounds: let their pulls be answered."""
        if not finished:
            return
        with self._cond:
            self.durable_version += 1
            for tensor, f in finished:
                f.durable = True
                self._notify(tensor)

    def replay(self, changes: list[Change]) -> int:
        """Apply journal records on top of a restored snapshot; how many rounds and
        expiries applied (worker bindings are applied and not counted).

        A record at or behind a tensor's open round minus one was already in the
        snapshot and is skipped; one beyond the open round means the journal does not
        belong to the snapshot (ValueError).
        """
        applied = 0
        with self._cond:
            for c in changes:
                if c.binding is not None:
                    worker, key, peer, since = c.binding
                    if key is None:
                        self.bindings.pop((c.tensor, worker), None)
                    else:
                        self.bindings[c.tensor, worker] = Binding(bytes.fromhex(key), peer,
                                                                  since, self.clock())
                    continue
                if c.dropped:
                    applied += self.tensors.pop(c.tensor, None) is not None
                    continue
                state = self.tensors.get(c.tensor)
                if state is None:
                    state = self.tensors[c.tensor] = self._new_state(c.numel, c.round)
                if c.round < state.round:
                    continue
                if c.round > state.round:
                    raise ValueError(f"journal record for round {c.round} of tensor "
                                     f"{c.tensor!r}, but the snapshot is at round "
                                     f"{state.round}")
                if c.error is not None:
                    state.last = Finished(c.round, error=c.error)
                else:
                    state.last = Finished(c.round, *self._aggregate(state, c.indices,
                                                                    c.values, c.k))
                state.round += 1
                state.touched = self.clock()
                applied += 1
        return applied

    def pop_events(self) -> list[tuple[str, int, str | None]]:
        """Rounds finished since the last call: (tensor, round, error or None)."""
        with self._cond:
            events, self.events = self.events, []
            return events

    # State for checkpoints and metrics -----------------------------------------------------
    def snapshot_and_take(self) -> tuple[dict[str, Any], list[Change],
                                         list[tuple[str, Finished]]]:
        """:meth:`snapshot` and :meth:`take_changes` at one instant: the snapshot holds
        every queued change, so writing it makes the returned rounds durable (if writing
        it fails, :meth:`requeue` the changes and rounds)."""
        with self._cond:
            changes, undurable = self.take_changes()
            return self.snapshot(), changes, undurable

    def snapshot(self) -> dict[str, Any]:
        """Everything a restarted server needs: rounds, residuals, last aggregates, and
        the worker bindings (as :attr:`Change.binding` tuples with the session first)."""
        with self._cond:
            tensors = {}
            for name, s in self.tensors.items():
                last = s.last
                tensors[name] = {
                    "numel": s.numel, "round": s.round,
                    "residual": None if s.residual is None else s.residual.copy(),
                    "last": None if last is None else {
                        "round": last.round, "error": last.error,
                        "indices": last.indices, "values": last.values},
                }
            bindings = [[session, *b.record(worker)]
                        for (session, worker), b in self.bindings.items()]
            return {"workers": self.workers, "shard": self.shard, "shards": self.shards,
                    "mode": self.mode, "tensors": tensors, "bindings": bindings}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Load a :meth:`snapshot`; refuses one from a differently configured server."""
        mine = {"workers": self.workers, "shard": self.shard, "shards": self.shards,
                "mode": self.mode}
        theirs = {key: snapshot.get(key) for key in mine}
        if theirs != mine:
            raise ValueError(f"checkpoint was written by a server with {theirs}, this one "
                             f"has {mine}: use a matching configuration or another "
                             "--checkpoint-dir")
        with self._cond:
            self.tensors = {}
            now = self.clock()
            for name, t in snapshot["tensors"].items():
                last = t["last"]
                self.tensors[name] = TensorState(
                    numel=t["numel"], round=t["round"], residual=t["residual"], touched=now,
                    last=None if last is None else Finished(
                        last["round"], last["indices"], last["values"], last["error"]))
            self.bindings = {(session, worker): Binding(bytes.fromhex(key), peer, since, now)
                             for session, worker, key, peer, since
                             in snapshot.get("bindings", ())}

    def rounds(self) -> dict[str, int]:
        """The open round of every tensor."""
        with self._cond:
            return {name: s.round for name, s in self.tensors.items()}

    def held_bytes(self) -> int:
        """Bytes of arrays held for all tensors (pushes, residuals, last aggregates)."""
        with self._cond:
            return sum(s.nbytes() for s in self.tensors.values())

    # Internals (lock held) -----------------------------------------------------------------
    def _check_available(self) -> None:
        if self.unavailable is not None:
            raise NotDurable(self.unavailable)

    def _check(self, frame: Frame, kind: Kind) -> None:
        if frame.kind is not kind:
            raise RequestError(f"{frame.where()}: expected a {kind.name.lower()} frame, "
                               f"got {frame.kind.name.lower()}")
        if (frame.shard, frame.shards) != (self.shard, self.shards):
            raise RequestError(f"{frame.where()}: sent to the server of shard "
                               f"{self.shard}/{self.shards} (check the client's address list "
                               "order)")
        if not 0 <= frame.worker < self.workers:
            raise RequestError(f"{frame.where()}: worker id must be below the server's "
                               f"--workers {self.workers}")
        if frame.numel > self.max_numel:
            raise RequestError(f"{frame.where()}: shard of {frame.numel} elements exceeds "
                               f"the server's limit of {self.max_numel} (--max-shard-numel)")

    def _new_state(self, numel: int, round: int) -> TensorState:
        state = TensorState(numel=numel, round=round, touched=self.clock())
        if self.mode == "topk":
            state.residual = np.zeros(numel, dtype=np.float32)
        return state

    def _register(self, frame: Frame) -> TensorState:
        state = self.tensors[frame.tensor] = self._new_state(frame.numel, frame.round)
        log.info("tensor %r registered at round %d (%d elements in this shard)",
                 frame.tensor, frame.round, frame.numel)
        return state

    def _check_numel(self, state: TensorState, frame: Frame) -> None:
        if frame.numel != state.numel:
            raise RequestError(f"{frame.where()}: shard has {frame.numel} elements, but this "
                               f"tensor was registered with {state.numel}")

    def _check_budget(self, frame: Frame) -> None:
        size = frame.indices.nbytes + frame.values.nbytes
        if self.push_budget is not None and self.pending_bytes + size > self.push_budget:
            raise OverBudget(
                f"{frame.where()}: holding this push ({size / 2**20:.1f} MB decoded) would "
                f"make the open rounds' pushes {(self.pending_bytes + size) / 2**20:.1f} MB, "
                f"over the server's budget of {self.push_budget / 2**20:.1f} MB "
                "(--max-push-mb): raise it, use more shards, or push fewer pairs")

    def _add(self, state: TensorState, frame: Frame) -> None:
        self.pending_bytes += frame.indices.nbytes + frame.values.nbytes
        state.pushed[frame.worker] = frame
        if state.opened is None:
            state.opened = self.clock()

    def _close(self, tensor: str, state: TensorState) -> None:
        pushes = [state.pushed[w] for w in sorted(state.pushed)]
        indices, values = sum_pushes(pushes, state.numel)
        k = max(f.count for f in pushes)
        state.last = Finished(state.round, *self._aggregate(state, indices, values, k),
                              durable=not self.durable)
        if self.durable:
            self.changes.append(Change(tensor, state.round, state.numel, indices, values, k))
            self._undurable.append((tensor, state.last))
        self.closed_rounds += 1
        self._finish(tensor, state, None)

    def _aggregate(self, state: TensorState, indices: np.ndarray, values: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
        """The round's aggregate from the union sum (updating the top-k residual)."""
        if self.mode == "topk":
            total = state.residual.copy()
            total[indices] += values
            if np.isfinite(total).all():
                k = min(k, state.numel)
                indices = np.sort(np.argpartition(-np.abs(total), k - 1)[:k]) if k else \
                    np.zeros(0, np.int64)
                values = total[indices]
                total[indices] = 0.0
                state.residual = total
            else:
                indices = np.arange(state.numel)
                values = total
        return indices.astype(np.int64, copy=False), values.astype(np.float32, copy=False)

    def _fail(self, tensor: str, state: TensorState, error: str) -> None:
        state.last = Finished(state.round, error=error, durable=not self.durable)
        if self.durable:
            self.changes.append(Change(tensor, state.round, state.numel, error=error))
            self._undurable.append((tensor, state.last))
        self.failed_rounds += 1
        self._finish(tensor, state, error)

    def _expire_idle_locked(self) -> None:
        now = self.clock()
        idle = [name for name, s in self.tensors.items()
                if now - s.touched >= self.idle_timeout]
        freed: dict[str, list[int]] = {}
        for name in idle:
            state = self.tensors.pop(name)
            held = state.nbytes()
            self._release(state)
            session = freed.setdefault(session_of(name), [0, 0])
            session[0] += 1
            session[1] += held
            if self.durable:
                self.changes.append(Change(name, dropped=True))
        self.expired_tensors += len(idle)
        unbound = self._expire_bindings_locked(now)
        for session, (count, held) in freed.items():
            workers = unbound.pop(session, 0)
            log.info("session %r expired after %g s idle: freed %d tensor%s (%d bytes)%s",
                     session, self.idle_timeout, count, "" if count == 1 else "s", held,
                     f" and {workers} worker binding{'' if workers == 1 else 's'}"
                     if workers else "")
        for session, workers in unbound.items():
            log.info("session %r expired after %g s idle: freed %d worker binding%s",
                     session, self.idle_timeout, workers, "" if workers == 1 else "s")
        if idle:
            release_memory()

    def _expire_bindings_locked(self, now: float) -> dict[str, int]:
        """Free the bindings idle for ``idle_timeout`` whose session has no tensor left;
        how many per session."""
        stale = [key for key, b in self.bindings.items()
                 if now - b.touched >= self.idle_timeout]
        if not stale:
            return {}
        live = {session_of(name) for name in self.tensors}
        freed: dict[str, int] = {}
        for session, worker in stale:
            if session in live:
                continue
            binding = self.bindings.pop((session, worker))
            freed[session] = freed.get(session, 0) + 1
            if self.durable:
                self.changes.append(Change(session, binding=(worker, None, binding.peer,
                                                             binding.since)))
        return freed

    def _expire_locked(self) -> None:
        now = self.clock()
        if self.freeze_gap is not None:
            gap = now - self._awake
            self._awake = now
            if gap > self.freeze_gap:  # requests that came meanwhile are still unread
                log.warning("the server did not run for %.1f s (stopped or starved); the "
                            "open rounds' deadlines move by as much", gap)
                for state in self.tensors.values():
                    if state.opened is not None:
                        state.opened += gap
        for tensor, state in self.tensors.items():
            if state.opened is None or now - state.opened < self.deadline:
                continue
            missing = sorted(set(range(self.workers)) - set(state.pushed))
            if not missing:
                continue
            noun = "worker" if len(missing) == 1 else "workers"
            error = (f"round {state.round} of tensor {tensor!r} (shard {self.shard}/"
                     f"{self.shards}) failed: {noun} {', '.join(map(str, missing))} did not "
                     f"push within the {self.deadline:g} s deadline ({len(state.pushed)} of "
                     f"{self.workers} pushed); the server continues with round "
                     f"{state.round + 1}")
            log.error("%s", error)
            self._fail(tensor, state, error)

    def _finish(self, tensor: str, state: TensorState, error: str | None) -> None:
        self.events.append((tensor, state.round, error))
        state.round += 1
        self._release(state)
        state.last_digests, state.digests = state.digests, {}
        state.opened = None
        if not self.durable:  # else pulls can answer only after mark_durable, which wakes
            self._notify(tensor)

    def _release(self, state: TensorState) -> None:
        """Drop the pushes of ``state``'s open round from the budget."""
        self.pending_bytes -= sum(f.indices.nbytes + f.values.nbytes
                                  for f in state.pushed.values())
        state.pushed = {}

    def _notify(self, tensor: str) -> None:
        self._cond.notify_all()
        for listener in self.listeners:
            listener(tensor)

    def _try_pull_locked(self, frame: Frame) -> bytes | None:
        self._check_available()
        state = self.tensors.get(frame.tensor)
        if state is None:
            raise UnknownTensor(f"{frame.where()}: no worker has pushed this tensor to this "
                                "server (was the server restarted without a checkpoint?)")
        self._check_numel(state, frame)
        state.touched = self.clock()
        last = state.last
        if last is not None and frame.round == last.round:
            if not last.durable:
                return None  # written to the journal first, then answered
            if last.error is not None:
                raise RoundFailed(last.error)
            encoded = last.encoded.get(frame.dtype)
            if encoded is None:
                encoded = encode_frame(Kind.AGGREGATE, frame.tensor, self.shard, self.shards,
                                       last.round, SERVER_ID, state.numel, last.indices,
                                       last.values, frame.dtype)
                last.encoded[frame.dtype] = encoded
            return encoded
        if frame.round == state.round:
            if state.opened is None:
                state.opened = self.clock()
            return None
        raise self._out_of_order(frame, state, "pull")

    def _out_of_order(self, frame: Frame, state: TensorState, what: str) -> RequestError:
        where = f"{what} for {frame.where()}"
        if frame.round < state.round:
            return StaleRound(f"{where} is stale: the server is at round {state.round} "
                              f"(last finished {state.last.round if state.last else 'none'})")
        waiting = sorted(set(range(self.workers)) - set(state.pushed))
        return FutureRound(f"{where} is ahead of the server, which is at round {state.round} "
                           f"(waiting for pushes from workers {waiting}); finish round "
                           f"{state.round} first")


def release_memory() -> None:
    """Give freed heap memory back to the operating system (glibc's ``malloc_trim``; a
    no-op elsewhere). Arrays of a few KB come from the heap, which otherwise keeps the
    pages of expired tensors: 2,000 expired top-k tensors left the RSS 70 MB higher
    without it."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_libc = _load_libc()


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
