"""What every transport calls: decode, apply to the store, count, log, checkpoint.

Transports hand over raw frames and get back raw frames or a :class:`RequestError`, whose
``code`` names the gRPC status to answer with (the MPI transport sends the name itself).

With a checkpoint directory, a writer thread keeps the checkpoint (see
:mod:`ps_server.checkpoint`) off the requests' path: it wakes when rounds finish, appends
the rounds finished since its last write to the journal as one record, and only then lets
their pulls be answered (:meth:`~ps_server.store.ShardStore.mark_durable`). Rounds that
finish while it writes go into its next record, so under load one write covers many
rounds. After ``checkpoint_every`` journaled rounds it writes a full snapshot instead and
starts a new journal, which bounds the journal's length and the time a restart replays.

A failed write (``OSError``: disk full, I/O error) loses nothing: what it took is put
back in the queue and the write is retried with back-off (:data:`RETRY_FIRST` doubling to
:data:`RETRY_MAX` seconds). Until one succeeds, :attr:`ShardService.failing` holds the
error and advice, every push and pull is refused with it (``UNAVAILABLE``,
:class:`~ps_server.store.NotDurable`), health is ``NOT_SERVING`` and no round is
answered; then the server goes on where it was. See ``docs/reliability.md``.

Identity: a gRPC call may carry its worker's identity, ``(session, worker, key)`` of
:func:`hvd_compress.ps_protocol.parse_identity`; :meth:`ShardService.push` and
:meth:`ShardService.decode_pull` check that the frame is for that worker and session and
claim the binding (:meth:`~ps_server.store.ShardStore.claim`); a call without identity
is refused for a bound worker. MPI calls pass ``sender`` (the worker of the rank the
message came from) instead and bind nothing: the rank is the identity.
"""

from __future__ import annotations

import errno
import logging
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from hvd_compress.ps_protocol import job_size_mismatch, session_of
from hvd_compress.sparse_wire import Frame, Kind, decode_frame
from ps_server import checkpoint
from ps_server.buffers import PushBuffers
from ps_server.metrics import Metrics
from ps_server.store import (
    Binding,
    JobSizeMismatch,
    LateRound,
    PullTimeout,
    RequestError,
    ShardStore,
    WorkerBound,
)

log = logging.getLogger("ps_server")

ACCEPTED = b"accepted"
DUPLICATE = b"duplicate"
CHECKPOINT_EVERY = 2000
"""Default rounds journaled between full snapshots (``--checkpoint-every``). A snapshot's
size follows the number of tensors, a journal record's the traffic of one write, and a
restart replays at most this many rounds: lower it to restart faster, raise it when
snapshots of many tensors cost too much. Figures: ``docs/benchmarks.md``, "Parameter
server"."""

RETRY_FIRST = 0.1
"""Seconds before the first retry of a failed checkpoint write; each further retry waits
twice as long, up to :data:`RETRY_MAX`."""
RETRY_MAX = 2.0


def write_failure(what: str, err: OSError, directory: Path) -> str:
    """The message that pushes and pulls are refused with while ``what`` ("journal" or
    "snapshot") writes fail with ``err``: the error, that the server retries, and what to
    do about it."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = f"free space on --checkpoint-dir {directory}"
    else:
        advice = f"check the disk and file system of --checkpoint-dir {directory}"
    # Clients recognise the words "the server keeps retrying and refuses pushes and
    # pulls" (hvd_compress.comm.ps_transport.grpc.NOT_DURABLE): keep them.
    return (f"{what} write failed: {err}; the server keeps retrying and refuses pushes "
            f"and pulls until it can make rounds durable: {advice}")


class ShardService:
    """One shard's request handling on top of a :class:`ShardStore`.

    ``checkpoint_dir`` turns on the journal writer (see the module docstring) and makes the
    store durable; ``fsync`` flushes each journal write to the disk. Call :meth:`restore`
    once before serving and :meth:`close` at the end (it writes a final snapshot).
    ``hide_names`` keeps tensor and session names out of the metrics' labels (see
    :meth:`_gauges`).
    """

    def __init__(self, store: ShardStore, checkpoint_dir: str | None = None,
                 checkpoint_every: int = CHECKPOINT_EVERY, fsync: bool = False,
                 hide_names: bool = False) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint interval must be at least 1 round, got "
                             f"{checkpoint_every}")
        self.store = store
        self.push_buffers = PushBuffers()  # the held pushes' arrays, recycled
        self.every, self.fsync = checkpoint_every, fsync
        self.hide_names = hide_names
        self.checkpoint = None if checkpoint_dir is None else checkpoint.path_for(
            checkpoint_dir, store.shard, store.shards)
        self._writing = "snapshot"  # what the writer writes now, for error messages
        self.failing: str | None = None  # the refusal while checkpoint writes fail
        self.failed_writes = 0  # failed attempts since the last successful write
        self._failing_since = 0.0
        self.health_listeners: list[Callable[[bool], None]] = []
        """Called from the writer thread with False when checkpoint writes start failing
        (the server is not serving) and True when they work again."""
        self.metrics = Metrics({"shard": f"{store.shard}/{store.shards}"}, self._gauges)
        self.generation = 0
        self.journaled = 0  # rounds in the current journal
        self.writes = self.snapshots = 0
        self.journal_bytes = self.snapshot_bytes = 0
        self.write_cpu = 0.0  # CPU seconds of the writer's thread (journal and snapshots)
        self._journal: checkpoint.Journal | None = None
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None
        self._job_sizes_logged: set[tuple[str, int]] = set()
        self._hosts: dict[tuple[str, int], str] = {}  # (session, worker) -> first host
        self._expired_seen = 0
        if self.checkpoint is not None:
            store.durable = True
            # A round a pull closes (by quorum, once its grace has passed) must be written
            # at once, not at the next push or tick.
            store.on_queued = self._wake.set
            self._writer = threading.Thread(target=self._write_loop, name="checkpoint",
                                            daemon=True)

    def restore(self) -> None:
        """Resume from the checkpoint (snapshot, then its journal) if there is one, write
        the result as a fresh snapshot, and start the writer."""
        if self.checkpoint is None:
            return
        config = {key: getattr(self.store, key) for key in ("workers", "shard", "shards",
                                                             "mode")}
        snapshot = checkpoint.load(self.checkpoint)
        generation = 0
        if snapshot is not None:
            self.store.restore(snapshot)
            generation = snapshot["generation"]
        journal = checkpoint.journal_path(self.checkpoint, generation)
        changes, torn = checkpoint.read_journal(journal, config)
        replayed = self.store.replay(changes)
        if snapshot is None and not changes:
            log.info("no checkpoint at %s: starting fresh", self.checkpoint)
        else:
            log.info("resumed from %s: open rounds %s (%d rounds replayed from the journal%s)",
                     self.checkpoint, self.store.rounds(), replayed,
                     f", {torn} bytes of a torn last write ignored" if torn else "")
        self.generation = generation
        self._snapshot()  # a clean start: new generation, stale journals deleted
        for stale in self.checkpoint.parent.glob(f"{self.checkpoint.stem}.journal-*"):
            if stale != self._journal.path:
                stale.unlink()
        self._writer.start()

    def close(self) -> None:
        """Stop the writer and write a final snapshot."""
        if self._writer is None:
            return
        self._stopping = True
        self._stop.set()
        self._wake.set()
        if self._writer.is_alive():
            self._writer.join()
        try:
            self.save_checkpoint()
        except OSError as err:
            log.error("final checkpoint snapshot failed (%s): the checkpoint in %s holds "
                      "every round answered before, and a restart resumes from there",
                      err, self.checkpoint.parent)
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    # Requests ------------------------------------------------------------------------------
    def check_job_size(self, workers: int, peer: str) -> None:
        """Refuse a client whose job has ``workers`` workers when the server has another
        ``--workers`` (logged once per peer and size)."""
        if workers == self.store.workers:
            return
        err = JobSizeMismatch(job_size_mismatch(workers, self.store.workers))
        self.metrics.inc("hvd_ps_requests_total", method="any", outcome=err.code.lower())
        self.metrics.rejected("any", err)
        if (peer, workers) not in self._job_sizes_logged:
            self._job_sizes_logged.add((peer, workers))
            log.error("refused %s: %s", peer, err)
        raise err

    def push(self, data: bytes, peer: str, sender: int | None = None,
             identity: tuple[str, int, bytes] | None = None) -> bytes:
        """Apply a push; answers ``accepted`` or ``duplicate`` (a retransmission, which
        changes nothing)."""
        frame = self._decode(data, "push", peer, sender, identity)
        digest = struct.unpack_from("<I", data, len(data) - 4)[0]  # the frame's CRC
        try:
            accepted = self.store.push(frame, digest, peer)
        except RequestError as err:
            self.after_requests()
            self._reject("push", peer, err)
        outcome = "accepted" if accepted else "duplicate"
        self.metrics.inc("hvd_ps_requests_total", method="push", outcome=outcome)
        self.metrics.pushed(frame.tensor, frame.round, accepted)
        if accepted:
            self._check_host(frame, peer)
            if log.isEnabledFor(logging.DEBUG):  # frame.where() formats a string
                log.debug("push accepted: %s (%d pairs) from %s", frame.where(), frame.count,
                          peer)
        else:
            log.info("retransmitted push ignored: %s from %s", frame.where(), peer)
        self.after_requests()
        return ACCEPTED if accepted else DUPLICATE

    def pull(self, data: bytes, peer: str, timeout: float, sender: int | None = None,
             identity: tuple[str, int, bytes] | None = None) -> bytes:
        """Wait for the round to finish and return the aggregate frame."""
        frame = self._decode(data, "pull", peer, sender, identity)
        try:
            result = self.store.pull(frame, timeout)
        except RequestError as err:
            self.after_requests()
            self._reject("pull", peer, err)
        return self._sent(result)

    def try_pull(self, frame: Frame, peer: str) -> bytes | None:
        """Non-blocking pull of an already decoded frame (for the MPI event loop)."""
        try:
            result = self.store.try_pull(frame)
        except RequestError as err:
            self._reject("pull", peer, err)
        return None if result is None else self._sent(result)

    def decode_pull(self, data: bytes, peer: str, sender: int | None = None,
                    identity: tuple[str, int, bytes] | None = None) -> Frame:
        return self._decode(data, "pull", peer, sender, identity)

    def identity_refused(self, method: str, session: str, worker: int, binding: Binding,
                         peer: str) -> str:
        """Count and log (WARNING, both peers) a call refused on its identity metadata
        alone, unread, because ``worker`` of ``session`` is bound to ``binding``'s
        process; the message to answer with."""
        err = WorkerBound(self.store.bound_error(session, worker, binding, peer, False))
        self.metrics.inc("hvd_ps_requests_total", method=method,
                         outcome=err.code.lower())
        self.metrics.rejected(method, err)
        log.warning("rejected %s from %s before reading it: %s", method, peer, err)
        return str(err)

    def timed_out(self, frame: Frame, peer: str, timeout: float) -> NoReturn:
        """Refuse a pull whose round is still open after ``timeout`` seconds."""
        self._reject("pull", peer, PullTimeout(
            f"{frame.where()}: round still open after {timeout:g} s (waiting for other "
            "workers' pushes)"))

    def tick(self) -> None:
        """Fail rounds past their deadline, expire idle tensors (and the hosts bound to
        their sessions), wake the checkpoint writer."""
        self.store.expire()
        if self.store.expired_tensors != self._expired_seen:
            self._expired_seen = self.store.expired_tensors
            self.push_buffers.release()  # like the store's malloc_trim after an expiry
            if self._hosts:
                live = {name.split("/", 1)[0] for name in self.store.rounds()}
                self._hosts = {key: host for key, host in self._hosts.items()
                               if key[0] in live}
        self.after_requests()

    def _check_host(self, frame: Frame, peer: str) -> None:
        """Bind each (session, worker) to the host of its first accepted push; warn when
        another host pushes as that worker. A host, not a connection: a client that
        reconnects (new port) after a blip or a server restart is the same worker, while a
        second process elsewhere with the same worker id is named at its first push (two
        on one host differ in content, which :meth:`ShardStore.push` refuses)."""
        host = peer.rpartition(":")[0] or peer
        key = (frame.tensor.split("/", 1)[0], frame.worker)
        first = self._hosts.setdefault(key, host)
        if first != host:
            log.warning("worker %d of session %r pushed from %s, but its first pushes came "
                        "from %s: two ranks share this worker id, or the job moved (%s)",
                        frame.worker, key[0], peer, first, frame.where())
            self._hosts[key] = host

    def after_requests(self) -> None:
        """Count finished rounds and wake the checkpoint writer when there are any."""
        events = self.store.pop_events()
        for tensor, round, error in events:
            self.metrics.round_finished(tensor, round, error)
            if not error:
                log.debug("round %d of tensor %r closed", round, tensor)
        if self._writer is not None and (events or self.store.changes):
            self._wake.set()

    def summary(self) -> str:
        """One line of totals for the log: rounds, pushes and bytes each way."""
        m = self.metrics
        return (f"{self.store.closed_rounds} rounds closed, {self.store.failed_rounds} failed; "
                f"{m.value('hvd_ps_requests_total', method='push', outcome='accepted'):.0f} "
                f"pushes accepted; {m.value('hvd_ps_received_bytes_total'):,.0f} bytes in, "
                f"{m.value('hvd_ps_sent_bytes_total'):,.0f} bytes out"
                + ("" if self.checkpoint is None else
                   f"; checkpoint: {self.writes} journal writes "
                   f"({self.journal_bytes:,} bytes), {self.snapshots} snapshots "
                   f"({self.snapshot_bytes:,} bytes), {self.write_cpu:.2f} s CPU writing"))

    def save_checkpoint(self) -> None:
        """Write a full snapshot now (and start a new journal)."""
        if self.checkpoint is None:
            return
        with self._write_lock:
            self._snapshot()

    def _write_loop(self) -> None:
        delay = RETRY_FIRST
        while not self._stopping:
            if self.failing is None:
                self._wake.wait()
            else:  # retry on the back-off clock, not on every finished round
                self._stop.wait(delay)
                delay = min(2 * delay, RETRY_MAX)
            self._wake.clear()
            try:
                self._write()
            except OSError as err:
                if self.failing is None:
                    delay = RETRY_FIRST
                self._write_failed(err, delay)
            except Exception:  # a bug, not the disk: keep serving; the log has it
                log.exception("checkpoint write to %s failed", self.checkpoint)
            else:
                if self.failing is not None:
                    self._write_recovered()

    def _write_failed(self, err: OSError, delay: float) -> None:
        """Refuse requests (health NOT_SERVING) with ``err`` until a write succeeds."""
        what = self._writing
        message = write_failure(what, err, self.checkpoint.parent)
        self.metrics.inc("hvd_ps_checkpoint_write_failures_total", what=what)
        self.failed_writes += 1
        if self.failing is None:
            self._failing_since = time.monotonic()
            log.error("%s; pushes and pulls are refused (UNAVAILABLE) and health is "
                      "NOT_SERVING until a write succeeds; next try in %.1f s", message, delay)
        elif message != self.failing:
            log.error("%s; next try in %.1f s", message, delay)
        else:
            log.debug("%s write still failing; next try in %.1f s", what, delay)
        if message != self.failing:
            self.failing = message
            self.store.set_unavailable(message)
            self._health_changed(False)

    def _write_recovered(self) -> None:
        log.warning("checkpoint writes to %s work again after %d failed attempts over "
                    "%.1f s; nothing queued was lost, serving again",
                    self.checkpoint.parent, self.failed_writes,
                    time.monotonic() - self._failing_since)
        self.failing = None
        self.failed_writes = 0
        self.store.set_unavailable(None)
        self._health_changed(True)

    def _health_changed(self, serving: bool) -> None:
        for listener in self.health_listeners:
            try:
                listener(serving)
            except Exception:  # a transport's bug must not stop the writer
                log.exception("health listener failed")

    def _write(self) -> None:
        """Journal the rounds finished since the last write, then release their pulls; a
        full snapshot instead once ``every`` rounds are in the journal (or when there is
        no usable journal). A failed write puts everything it took back (see
        :meth:`ShardStore.requeue`) and raises its ``OSError``."""
        with self._write_lock:
            began = time.thread_time()
            if self._journal is None or self.journaled >= self.every:
                self._snapshot()
                return
            changes, finished = self.store.take_changes()
            if not changes:
                return
            checkpoint.fault_point("closed")
            self._writing = "journal"
            try:
                self.journal_bytes += self._journal.append(changes)
            except OSError:
                self.store.requeue(changes, finished)
                if self._journal.broken:
                    self._journal.close()
                    self._journal = None
                raise
            checkpoint.fault_point("journal-written")
            self.journaled += len(changes)
            self.writes += 1
            self.store.mark_durable(finished)
            self.write_cpu += time.thread_time() - began

    def _snapshot(self) -> None:
        """Snapshot generation g + 1, delete journal g, start journal g + 1 (lock held).

        The rounds are durable once the snapshot is renamed into place; if starting the
        new journal then fails, the next write is a snapshot again."""
        began = time.thread_time()
        snapshot, changes, finished = self.store.snapshot_and_take()
        generation = self.generation + 1
        self._writing = "snapshot"
        try:
            self.snapshot_bytes += checkpoint.save(self.checkpoint, snapshot, generation)
        except OSError:
            self.store.requeue(changes, finished)
            raise
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        checkpoint.journal_path(self.checkpoint, self.generation).unlink(missing_ok=True)
        self.generation, self.journaled = generation, 0
        self.snapshots += 1
        self.store.mark_durable(finished)
        self.metrics.inc("hvd_ps_checkpoints_total")
        self._writing = "journal"
        self._journal = checkpoint.Journal(
            checkpoint.journal_path(self.checkpoint, generation),
            {key: snapshot[key] for key in ("workers", "shard", "shards", "mode")},
            self.fsync)
        self.write_cpu += time.thread_time() - began
        log.debug("checkpoint snapshot %d written to %s", generation, self.checkpoint)

    # Internals -----------------------------------------------------------------------------
    def _decode(self, data: bytes, method: str, peer: str, sender: int | None,
                identity: tuple[str, int, bytes] | None) -> Frame:
        """The checked frame of a request; with ``sender`` None (not MPI), the call's
        worker binding claimed (see the module docstring)."""
        self.metrics.inc("hvd_ps_received_bytes_total", len(data))
        try:
            frame = decode_frame(data, self.store.max_numel, self.push_buffers.lend)
        except ValueError as err:
            self._reject(method, peer, RequestError(f"malformed {method} frame: {err}"))
        expected = Kind.PUSH if method == "push" else Kind.PULL
        if frame.kind is not expected:
            self._reject(method, peer, RequestError(
                f"{frame.where()}: {method} carries a {frame.kind.name.lower()} frame"))
        if method == "pull" and frame.count:
            self._reject(method, peer, RequestError(
                f"{frame.where()}: a pull carries no pairs, this one has {frame.count}"))
        if sender is not None:
            if frame.worker != sender:
                self._reject(method, peer, RequestError(
                    f"{frame.where()}: frame claims worker {frame.worker} but came from "
                    f"worker {sender}"))
            return frame
        session = session_of(frame.tensor)
        key = None
        if identity is not None:
            claimed, worker, key = identity
            if (claimed, worker) != (session, frame.worker):
                self._reject(method, peer, RequestError(
                    f"{frame.where()}: the frame is for worker {frame.worker} of session "
                    f"{session!r}, but the call's identity is worker {worker} of session "
                    f"{claimed!r}"))
        try:
            self.store.claim(session, frame.worker, key, peer)
        except WorkerBound as err:
            self._reject(method, peer, err)
        return frame

    def _sent(self, result: bytes) -> bytes:
        checkpoint.fault_point("answered")
        self.metrics.inc("hvd_ps_requests_total", method="pull", outcome="ok")
        self.metrics.inc("hvd_ps_sent_bytes_total", len(result))
        return result

    def _reject(self, method: str, peer: str, err: RequestError) -> NoReturn:
        self.metrics.inc("hvd_ps_requests_total", method=method, outcome=err.code.lower())
        self.metrics.rejected(method, err)
        # A timed-out pull is retried, a late push kept for later: neither is a fault.
        level = logging.INFO if isinstance(err, PullTimeout | LateRound) else logging.WARNING
        log.log(level, "rejected %s from %s: %s", method, peer, err)
        raise err

    def _gauges(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Gauge samples at scrape time: the open round per tensor (or, with
        ``hide_names``, the lowest and highest open round over tensors, so a stuck tensor
        still shows as a gap without naming it), the sessions and the bytes held."""
        rounds = self.store.rounds()
        if self.hide_names:
            per_tensor = {("hvd_ps_open_round", (("stat", stat),)): float(pick(rounds.values()))
                          for stat, pick in (("min", min), ("max", max)) if rounds}
        else:
            per_tensor = {("hvd_ps_open_round", (("tensor", name),)): float(r)
                          for name, r in rounds.items()}
        return {**per_tensor,
                ("hvd_ps_open_sessions", ()): float(len({n.split("/")[0] for n in rounds})),
                ("hvd_ps_held_bytes", ()): float(self.store.held_bytes()),
                ("hvd_ps_checkpoint_failing", ()): float(self.failing is not None)}
