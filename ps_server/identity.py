"""Worker identity on the gRPC transport: each (session, worker) bound to one process.

Every gRPC client process draws a random secret when it is made and sends it with each
call (:func:`hvd_compress.ps_protocol.identity_metadata`); :class:`WorkerBindings` binds
each (session, worker) to the first secret it sees (keeping a digest of it, the first peer
and the time) and refuses any later call for that worker of that session with another
secret, or with none, as :class:`~ps_server.errors.WorkerBound` (``PERMISSION_DENIED``),
naming the first peer. The gRPC transport asks :meth:`WorkerBindings.bound_elsewhere`
before the request's body is read, so an impersonating push is refused unread and never
reaches a round; the content check of :mod:`ps_server.rounds` stays for clients that
send no identity.

Why a per-process secret, not a key derived from the token: every worker holds the same
token, so any token holder could derive any worker's key; what tells two processes apart
is something only one of them has. Why not the first connection: a client reconnects
(new port, new connection) after a network blip or a server restart and must stay the
same worker, which the secret does since it lives as long as the client. A process that
replaces a dead one (a new secret) is refused until the session expires; jobs start a
new session per run anyway.

Bindings are state like rounds (see :mod:`ps_server.durability`): a new binding is
journaled ahead of any round its worker's pushes close, so a restarted server keeps
refusing the same impersonator. A binding whose session has no tensor left and whose
worker made no call for the idle timeout is freed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from ps_server.errors import WorkerBound

log = logging.getLogger("ps_server")

BindingRecord = tuple[int, "str | None", str, float]
"""A binding as journaled: (worker, key as hex or None when freed, first peer, first seen
as Unix time)."""


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
        """The journal record (:data:`BindingRecord`) of this binding for ``worker``."""
        return worker, self.key.hex(), self.peer, self.since


class WorkerBindings:
    """The bindings of one shard, ``bindings[session, worker]``. Not locked: the store
    calls every method but :meth:`bound_elsewhere` with its lock held."""

    def __init__(self, workers: int, shard: int, shards: int,
                 idle_timeout: float | None) -> None:
        self.workers, self.shard, self.shards = workers, shard, shards
        self.idle_timeout = idle_timeout
        self.bindings: dict[tuple[str, int], Binding] = {}

    def bound_elsewhere(self, session: str, worker: int, key: bytes | None
                        ) -> Binding | None:
        """The binding of ``worker`` of ``session`` if it is to another process than the
        one with ``key`` (None: a call without identity), else None. Reads one entry
        without a lock, so a transport may ask before it reads a request's body."""
        binding = self.bindings.get((session, worker))
        return None if binding is None or binding.key == key else binding

    def claim(self, session: str, worker: int, key: bytes | None, peer: str, now: float
              ) -> Binding | None:
        """Bind ``worker`` of ``session`` to the process with ``key`` if it is unbound
        (returning the new binding, to journal), or refuse the call (:class:`WorkerBound`)
        if it is bound to another process or ``key`` is None and it is bound at all. Ids
        out of range are left to the frame checks; calls without identity bind nothing."""
        binding = self.bindings.get((session, worker))
        if binding is None:
            if key is None or not 0 <= worker < self.workers:
                return None
            binding = Binding(key, peer, time.time(), now)
            self.bindings[session, worker] = binding
            log.info("worker %d of session %r bound to the process at %s", worker, session,
                     peer)
            return binding
        if binding.key != key:
            raise WorkerBound(self.error(session, worker, binding, peer, key is None))
        binding.touched = now
        return None

    def error(self, session: str, worker: int, binding: Binding, peer: str,
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

    def expire(self, now: float, live: set[str]) -> list[tuple[str, int, Binding]]:
        """Free the bindings idle for the idle timeout whose session is not in ``live``;
        the freed ones as (session, worker, binding)."""
        stale = [key for key, b in self.bindings.items()
                 if now - b.touched >= self.idle_timeout]
        return [(session, worker, self.bindings.pop((session, worker)))
                for session, worker in stale if session not in live]

    def rows(self) -> list[list]:
        """Every binding as ``[session, *record]``, for a snapshot."""
        return [[session, *b.record(worker)] for (session, worker), b in self.bindings.items()]

    def load(self, rows: list[list], now: float) -> None:
        """Replace the bindings by a snapshot's :meth:`rows`."""
        self.bindings = {(session, worker): Binding(bytes.fromhex(key), peer, since, now)
                         for session, worker, key, peer, since in rows}

    def apply(self, session: str, record: BindingRecord, now: float) -> None:
        """Apply a journaled binding (or, with key None, its release)."""
        worker, key, peer, since = record
        if key is None:
            self.bindings.pop((session, worker), None)
        else:
            self.bindings[session, worker] = Binding(bytes.fromhex(key), peer, since, now)
