"""What every transport calls: decode, apply to the store, count, log, checkpoint.

Transports hand over raw frames and get back raw frames or a :class:`RequestError`, whose
``code`` names the gRPC status to answer with (the MPI transport sends the name itself).
"""

from __future__ import annotations

import logging
import threading
from typing import NoReturn

from hvd_compress.sparse_wire import Frame, Kind, decode_frame
from ps_server import checkpoint
from ps_server.metrics import Metrics
from ps_server.store import PullTimeout, RequestError, ShardStore

log = logging.getLogger("ps_server")

ACCEPTED = b"accepted"
DUPLICATE = b"duplicate"


class ShardService:
    """One shard's request handling on top of a :class:`ShardStore`."""

    def __init__(self, store: ShardStore, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 1) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint interval must be at least 1 round, got "
                             f"{checkpoint_every}")
        self.store = store
        self.every = checkpoint_every
        self.checkpoint = None if checkpoint_dir is None else checkpoint.path_for(
            checkpoint_dir, store.shard, store.shards)
        self.metrics = Metrics({"shard": f"{store.shard}/{store.shards}"}, self._gauges)
        self._checkpoint_lock = threading.Lock()

    def restore(self) -> None:
        """Resume from the checkpoint file if there is one."""
        if self.checkpoint is None:
            return
        snapshot = checkpoint.load(self.checkpoint)
        if snapshot is None:
            log.info("no checkpoint at %s: starting fresh", self.checkpoint)
            return
        self.store.restore(snapshot)
        rounds = {name: t["round"] for name, t in snapshot["tensors"].items()}
        log.info("resumed from %s: open rounds %s", self.checkpoint, rounds)

    # Requests ------------------------------------------------------------------------------
    def push(self, data: bytes, peer: str, sender: int | None = None) -> bytes:
        """Apply a push; answers ``accepted`` or ``duplicate`` (which changes nothing)."""
        frame = self._decode(data, "push", peer, sender)
        try:
            accepted = self.store.push(frame)
        except RequestError as err:
            self._reject("push", peer, err)
        outcome = "accepted" if accepted else "duplicate"
        self.metrics.inc("hvd_ps_requests_total", method="push", outcome=outcome)
        if accepted:
            log.debug("push accepted: %s (%d pairs) from %s", frame.where(), frame.count, peer)
        else:
            log.info("duplicate push ignored: %s from %s", frame.where(), peer)
        self.after_requests()
        return ACCEPTED if accepted else DUPLICATE

    def pull(self, data: bytes, peer: str, timeout: float, sender: int | None = None) -> bytes:
        """Wait for the round to finish and return the aggregate frame."""
        frame = self._decode(data, "pull", peer, sender)
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

    def decode_pull(self, data: bytes, peer: str, sender: int | None = None) -> Frame:
        return self._decode(data, "pull", peer, sender)

    def tick(self) -> None:
        """Fail rounds past their deadline and write due checkpoints."""
        self.store.expire()
        self.after_requests()

    def after_requests(self) -> None:
        """Count finished rounds and write a checkpoint when one is due."""
        due = False
        for tensor, round, error in self.store.pop_events():
            name = "hvd_ps_rounds_failed_total" if error else "hvd_ps_rounds_closed_total"
            self.metrics.inc(name)
            if not error:
                log.debug("round %d of tensor %r closed", round, tensor)
            due = due or round % self.every == 0
        if due:
            self.save_checkpoint()

    def summary(self) -> str:
        """One line of totals for the log: rounds, pushes and bytes each way."""
        m = self.metrics
        return (f"{self.store.closed_rounds} rounds closed, {self.store.failed_rounds} failed; "
                f"{m.value('hvd_ps_requests_total', method='push', outcome='accepted'):.0f} "
                f"pushes accepted; {m.value('hvd_ps_received_bytes_total'):,.0f} bytes in, "
                f"{m.value('hvd_ps_sent_bytes_total'):,.0f} bytes out")

    def save_checkpoint(self) -> None:
        if self.checkpoint is None:
            return
        with self._checkpoint_lock:  # snapshot inside the lock: later writes are newer
            checkpoint.save(self.checkpoint, self.store.snapshot())
        self.metrics.inc("hvd_ps_checkpoints_total")
        log.debug("checkpoint written to %s", self.checkpoint)

    # Internals -----------------------------------------------------------------------------
    def _decode(self, data: bytes, method: str, peer: str, sender: int | None) -> Frame:
        self.metrics.inc("hvd_ps_received_bytes_total", len(data))
        try:
            frame = decode_frame(data, self.store.max_numel)
        except ValueError as err:
            self._reject(method, peer, RequestError(f"malformed {method} frame: {err}"))
        expected = Kind.PUSH if method == "push" else Kind.PULL
        if frame.kind is not expected:
            self._reject(method, peer, RequestError(
                f"{frame.where()}: {method} carries a {frame.kind.name.lower()} frame"))
        if sender is not None and frame.worker != sender:
            self._reject(method, peer, RequestError(
                f"{frame.where()}: frame claims worker {frame.worker} but came from worker "
                f"{sender}"))
        return frame

    def _sent(self, result: bytes) -> bytes:
        self.metrics.inc("hvd_ps_requests_total", method="pull", outcome="ok")
        self.metrics.inc("hvd_ps_sent_bytes_total", len(result))
        return result

    def _reject(self, method: str, peer: str, err: RequestError) -> NoReturn:
        self.metrics.inc("hvd_ps_requests_total", method=method, outcome=err.code.lower())
        level = logging.INFO if isinstance(err, PullTimeout) else logging.WARNING
        log.log(level, "rejected %s from %s: %s", method, peer, err)
        raise err

    def _gauges(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {("hvd_ps_open_round", (("tensor", name),)): float(r)
                for name, r in self.store.rounds().items()}
