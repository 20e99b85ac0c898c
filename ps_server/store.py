"""One shard of every tensor: the round state machine, safe to call from many threads.

:class:`ShardStore` keeps, per tensor, the rounds of :mod:`ps_server.rounds`, binds
workers to processes (:mod:`ps_server.identity`) and, when the server keeps checkpoints,
queues what must be journaled before a round is answered (:mod:`ps_server.durability`).
It does no I/O. The names of those modules (and of :mod:`ps_server.errors`) stay
importable from here.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from hvd_compress.ps_protocol import late_detail, quorum_sender, session_of
from hvd_compress.sparse_wire import Frame, Kind
from ps_server import durability
from ps_server.durability import Change
from ps_server.errors import (
    ConflictingPush,
    FutureRound,
    JobSizeMismatch,
    LateRound,
    NotDurable,
    OverBudget,
    PullTimeout,
    RequestError,
    RoundFailed,
    StaleRound,
    UnknownTensor,
    WorkerBound,
)
from ps_server.identity import Binding, WorkerBindings
from ps_server.rounds import (
    AGGREGATE_KINDS,
    MODES,
    Finished,
    HeapKeeper,
    Quorum,
    TensorState,
    close_pushes,
    encode_aggregate,
    new_state,
    release_memory,
    sum_pushes,
)

__all__ = ["MODES", "Binding", "Change", "ConflictingPush", "Finished", "FutureRound",
           "JobSizeMismatch", "LateRound", "NotDurable", "OverBudget", "PullTimeout",
           "Quorum", "RequestError", "RoundFailed", "ShardStore", "StaleRound", "TensorState",
           "UnknownTensor", "WorkerBound", "release_memory", "sum_pushes"]
log = logging.getLogger("ps_server")


class ShardStore:
    """The state of one shard of every tensor, with the round state machine of
    :mod:`ps_server.rounds`.

    Finished rounds are queued for :meth:`pop_events`, which the server drains to count
    rounds, and with ``durable`` also for :meth:`take_changes` (see
    :mod:`ps_server.durability`).
    ``idle_timeout`` (seconds, None for never) expires tensors nobody used for that long.
    ``push_budget`` (bytes, None for no limit) bounds the decoded pairs that the pushes of
    open rounds hold together; a push that would exceed it is refused (``OverBudget``)
    before it is held, unless it is the last of its round (the close frees them all).
    Functions in ``listeners`` are called with a tensor's name (lock held: they must only
    schedule work) whenever a pull of it may now have an answer.
    ``quorum`` (:class:`~ps_server.rounds.Quorum`, None for all workers) lets a round close
    without every worker; ``partial_rounds`` and ``late_pushes`` count what it did.
    ``heap`` (:class:`~ps_server.rounds.HeapKeeper`, None to leave glibc's heap as it is:
    a server process passes one) is told the size of every aggregate frame encoded.
    """

    def __init__(self, workers: int, shard: int, shards: int, mode: str = "union",
                 deadline: float = 120.0, max_numel: int = 1 << 28,
                 clock: Callable[[], float] = time.monotonic, durable: bool = False,
                 idle_timeout: float | None = None, push_budget: int | None = None,
                 quorum: Quorum | None = None, heap: HeapKeeper | None = None) -> None:
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
        self.heap = heap
        self.quorum = Quorum(workers, workers) if quorum is None else quorum
        if self.quorum.workers != workers:
            raise ValueError(f"the quorum is of {self.quorum.workers} workers, the server "
                             f"has {workers}")
        if self.quorum.partial and self.quorum.grace >= deadline:
            raise ValueError(f"grace ({self.quorum.grace:g} s) must be below the round "
                             f"deadline ({deadline:g} s)")
        self.partial_rounds = 0  # closed without every worker
        self.late_pushes = 0  # refused because their round had closed without them
        self.pending_bytes = 0  # decoded pairs held by the pushes of open rounds
        self.tensors: dict[str, TensorState] = {}
        self.identity = WorkerBindings(workers, shard, shards, idle_timeout)
        self.closed_rounds = 0
        self.failed_rounds = 0
        self.expired_tensors = 0
        self.events: list[tuple[str, int, str | None]] = []  # (tensor, round, error)
        self.changes: list[Change] = []  # for the journal, when durable
        self._undurable: list[tuple[str, Finished]] = []
        self.listeners: list[Callable[[str], None]] = []
        # Called (lock held) when a finished round is queued for the journal.
        self.on_queued: Callable[[], None] | None = None
        self.durable_version = 0  # counts mark_durable calls, for polling transports
        self.unavailable: str | None = None  # why rounds cannot be made durable now
        self._unavailable_since = 0.0
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
                if self.quorum.closes(len(state.pushed), state.opened, self.clock()):
                    self._close(frame.tensor, state)
                return True
            finished = state.finished(r) if r < state.round else None
            if finished is not None:
                if finished.error is not None:
                    raise RoundFailed(finished.error)
                first = finished.digests.get(w)
                if first is not None:
                    self._check_same(frame.tensor, state, r, w, digest, peer, first,
                                     open_round=False)
                elif finished.contributors and w not in finished.contributors:
                    self.late_pushes += 1
                    raise self._late(frame, finished, state.round)
                return False  # worker w pushed round r before it closed
            raise self._out_of_order(frame, state, "push")

    def _late(self, frame: Frame, finished: Finished, open_round: int) -> LateRound:
        """The refusal of a late push; its message ends with the open round
        (:func:`~hvd_compress.ps_protocol.late_detail`), so the worker skips to it."""
        count = len(finished.contributors)
        return LateRound(late_detail(
            f"push for {frame.where()} is late: the round closed with {count} of "
            f"{self.workers} workers (--quorum {self.quorum.size}, --grace "
            f"{self.quorum.grace:g} s) and does not hold it; keep these pairs for a later "
            "round and pull this round's aggregate", open_round))

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

    @property
    def bindings(self) -> dict[tuple[str, int], Binding]:
        """The worker bindings, by (session, worker) (see :mod:`ps_server.identity`)."""
        return self.identity.bindings

    def bound_elsewhere(self, session: str, worker: int, key: bytes | None
                        ) -> Binding | None:
        """:meth:`WorkerBindings.bound_elsewhere <ps_server.identity.WorkerBindings.
        bound_elsewhere>`: safe to ask without the lock, before a request's body is read."""
        return self.identity.bound_elsewhere(session, worker, key)

    def claim(self, session: str, worker: int, key: bytes | None, peer: str) -> None:
        """Bind ``worker`` of ``session`` to the process with ``key``, or refuse the call
        (:class:`WorkerBound`); see :meth:`ps_server.identity.WorkerBindings.claim`. With
        ``durable``, a new binding is queued for the journal."""
        with self._cond:
            binding = self.identity.claim(session, worker, key, peer, self.clock())
            if binding is not None and self.durable:
                self.changes.append(Change(session, binding=binding.record(worker)))

    def bound_error(self, session: str, worker: int, binding: Binding, peer: str,
                    anonymous: bool) -> str:
        """The refusal of a call from ``peer`` for ``worker`` of ``session``, which is
        bound to the process of ``binding``."""
        return self.identity.error(session, worker, binding, peer, anonymous)

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
                until = min(give_up, opened + self.deadline)
                if self.quorum.partial:  # it may close by quorum when the grace has passed
                    until = min(until, max(opened + self.quorum.grace, now + 1e-3))
                self._cond.wait(max(until - now, 0.0) + 1e-3)

    def quorum_wait(self, tensor: str) -> float | None:
        """Seconds until ``tensor``'s open round may close by quorum without another push
        (its grace ends), for transports whose pulls wait on events: after that, asking
        again (:meth:`try_pull`) closes it. None when no such time is pending."""
        with self._cond:
            state = self.tensors.get(tensor)
            if not self.quorum.partial or state is None or state.opened is None:
                return None
            left = state.opened + self.quorum.grace - self.clock()
            return left if left > 0 else None

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
        :class:`NotDurable` (``reason`` as its message), waking the pulls that wait, and
        fail no round for a missed deadline; None serves again, with the open rounds'
        deadlines moved by the time requests were refused."""
        with self._cond:
            now = self.clock()
            if reason is not None and self.unavailable is None:
                self._unavailable_since = now
            elif reason is None and self.unavailable is not None:
                # Pushes were refused meanwhile: no worker missed a deadline by then.
                for state in self.tensors.values():
                    if state.opened is not None:
                        state.opened += now - self._unavailable_since
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
        expiries applied (see :func:`ps_server.durability.replay`)."""
        with self._cond:
            return durability.replay(changes, self.mode, self.tensors, self.identity,
                                     self.clock())

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
        """Everything a restarted server needs (:func:`ps_server.durability.snapshot`)."""
        with self._cond:
            return durability.snapshot(self._config(), self.tensors, self.identity)

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Load a :meth:`snapshot`; refuses one from a differently configured server."""
        with self._cond:
            now = self.clock()
            self.tensors = durability.restore(self._config(), snapshot, now)
            self.identity.load(snapshot.get("bindings", ()), now)

    def _config(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in durability.CONFIG}

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

    def _register(self, frame: Frame) -> TensorState:
        state = new_state(self.mode, frame.numel, frame.round, self.clock())
        self.tensors[frame.tensor] = state
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
        contributors = tuple(sorted(state.pushed))
        pushes = [state.pushed[w] for w in contributors]
        k = max(f.count for f in pushes)
        (indices, values), result = close_pushes(self.mode, state, pushes, k)
        state.last = Finished(state.round, *result, durable=not self.durable,
                              contributors=contributors, digests=state.digests)
        partial = len(contributors) < self.workers
        if self.durable:
            self.changes.append(Change(tensor, state.round, state.numel, indices, values, k,
                                       contributors=contributors if partial else None))
            self._undurable.append((tensor, state.last))
        if self.quorum.partial:  # kept for the pulls of late workers
            state.history[state.round] = state.last
            state.history.pop(state.round - self.quorum.keep, None)
        self.closed_rounds += 1
        self.partial_rounds += partial
        self._finish(tensor, state, None)

    def _fail(self, tensor: str, state: TensorState, error: str) -> None:
        state.last = Finished(state.round, error=error, durable=not self.durable,
                              digests=state.digests)
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
            if self.heap is not None:
                self.heap.forget(idle)
            release_memory()

    def _expire_bindings_locked(self, now: float) -> dict[str, int]:
        """Free the bindings idle for ``idle_timeout`` whose session has no tensor left;
        how many per session."""
        live = {session_of(name) for name in self.tensors}
        freed: dict[str, int] = {}
        for session, worker, binding in self.identity.expire(now, live):
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
        if self.unavailable is not None:  # pushes are refused: no one can be late
            return
        for tensor, state in self.tensors.items():
            if self.quorum.partial and state.pushed and \
                    self.quorum.closes(len(state.pushed), state.opened, now):
                self._close(tensor, state)
                continue
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
        elif self.on_queued is not None:
            self.on_queued()

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
        last = state.finished(frame.round)
        if last is not None:
            if not last.durable:
                return None  # written to the journal first, then answered
            if last.error is not None:
                raise RoundFailed(last.error)
            encoded = last.encoded.get(frame.dtype)
            if encoded is None:
                sender = quorum_sender(self.workers - len(last.contributors)
                                       if last.contributors else 0)
                encoded = encode_aggregate(frame.tensor, self.shard, self.shards, last, sender,
                                           state.numel, frame.dtype, AGGREGATE_KINDS[self.mode])
                last.encoded[frame.dtype] = encoded
                if self.heap is not None:
                    self.heap.fit(frame.tensor, len(encoded), self.workers)
            return encoded
        if frame.round == state.round:
            if state.opened is None:
                state.opened = self.clock()
            return None
        raise self._out_of_order(frame, state, "pull")

    def _out_of_order(self, frame: Frame, state: TensorState, what: str) -> RequestError:
        where = f"{what} for {frame.where()}"
        if frame.round < state.round:
            kept = (f"; it keeps the aggregates of the last {self.quorum.keep} closed rounds "
                    "for late workers: this worker fell further behind"
                    if self.quorum.partial else "")
            return StaleRound(f"{where} is stale: the server is at round {state.round} "
                              f"(last finished {state.last.round if state.last else 'none'})"
                              + kept)
        waiting = sorted(set(range(self.workers)) - set(state.pushed))
        return FutureRound(f"{where} is ahead of the server, which is at round {state.round} "
                           f"(waiting for pushes from workers {waiting}); finish round "
                           f"{state.round} first")
