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
Pushes are idempotent on (worker, round, shard); rounds before the last finished one are
stale, rounds after the open one are in the future: both are rejected. The first push or
pull of a round starts its deadline; a round still missing workers when it passes fails
with an error naming them, and the next round opens. The first push of an unknown tensor
fixes its round and size; after a restore from a checkpoint, the first push may also move
a tensor forward (workers may be ahead of the last checkpoint).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvd_compress.native import sparse as native_sparse
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


@dataclass
class Finished:
    """The outcome of a finished round: pairs, or the error that failed it."""

    round: int
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    error: str | None = None
    encoded: dict[ValueDType, bytes] = field(default_factory=dict)


@dataclass
class TensorState:
    numel: int
    round: int
    pushed: dict[int, Frame] = field(default_factory=dict)  # this round's, by worker
    opened: float | None = None
    residual: np.ndarray | None = None
    last: Finished | None = None
    resumed: bool = False


class ShardStore:
    """The state of one shard of every tensor, with the round state machine above.

    Finished rounds are queued for :meth:`pop_events`, which the server drains to write
    checkpoints and count rounds.
    """

    def __init__(self, workers: int, shard: int, shards: int, mode: str = "union",
                 deadline: float = 120.0, max_numel: int = 1 << 28,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if not 0 <= shard < shards:
            raise ValueError(f"shard must satisfy 0 <= shard < shards, got {shard}/{shards}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if deadline <= 0:
            raise ValueError(f"deadline must be positive, got {deadline}")
        self.workers, self.shard, self.shards = workers, shard, shards
        self.mode, self.deadline, self.max_numel = mode, deadline, max_numel
        self.clock = clock
        self.tensors: dict[str, TensorState] = {}
        self.closed_rounds = 0
        self.failed_rounds = 0
        self.events: list[tuple[str, int, str | None]] = []  # (tensor, round, error)
        self._cond = threading.Condition()

    # Requests ------------------------------------------------------------------------------
    def push(self, frame: Frame) -> bool:
        """Add a worker's pairs to its round. True if accepted, False if a duplicate."""
        self._check(frame, Kind.PUSH)
        with self._cond:
            self._expire_locked()
            state = self.tensors.get(frame.tensor)
            if state is None:
                state = self._register(frame)
            self._check_numel(state, frame)
            if state.resumed and frame.round > state.round and not state.pushed:
                log.info("tensor %r resumed at round %d (the checkpoint was at round %d)",
                         frame.tensor, frame.round, state.round)
                state.round, state.resumed, state.last = frame.round, False, None
            r = frame.round
            if r == state.round:
                if frame.worker in state.pushed:
                    return False
                self._add(state, frame)
                if len(state.pushed) == self.workers:
                    self._close(frame.tensor, state)
                return True
            if state.last is not None and r == state.last.round:
                if state.last.error is not None:
                    raise RoundFailed(state.last.error)
                return False  # every worker pushed round r before it closed
            raise self._out_of_order(frame, state, "push")

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
        """Fail every open round whose deadline has passed."""
        with self._cond:
            self._expire_locked()

    def pop_events(self) -> list[tuple[str, int, str | None]]:
        """Rounds finished since the last call: (tensor, round, error or None)."""
        with self._cond:
            events, self.events = self.events, []
            return events

    # State for checkpoints and metrics -----------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a restarted server needs: rounds, residuals, last aggregates."""
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
            return {"workers": self.workers, "shard": self.shard, "shards": self.shards,
                    "mode": self.mode, "tensors": tensors}

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
            for name, t in snapshot["tensors"].items():
                last = t["last"]
                self.tensors[name] = TensorState(
                    numel=t["numel"], round=t["round"], residual=t["residual"], resumed=True,
                    last=None if last is None else Finished(
                        last["round"], last["indices"], last["values"], last["error"]))

    def rounds(self) -> dict[str, int]:
        """The open round of every tensor."""
        with self._cond:
            return {name: s.round for name, s in self.tensors.items()}

    # Internals (lock held) -----------------------------------------------------------------
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
        state = TensorState(numel=frame.numel, round=frame.round)
        if self.mode == "topk":
            state.residual = np.zeros(frame.numel, dtype=np.float32)
        self.tensors[frame.tensor] = state
        log.info("tensor %r registered at round %d (%d elements in this shard)",
                 frame.tensor, frame.round, frame.numel)
        return state

    def _check_numel(self, state: TensorState, frame: Frame) -> None:
        if frame.numel != state.numel:
            raise RequestError(f"{frame.where()}: shard has {frame.numel} elements, but this "
                               f"tensor was registered with {state.numel}")

    def _add(self, state: TensorState, frame: Frame) -> None:
        state.pushed[frame.worker] = frame
        if state.opened is None:
            state.opened = self.clock()

    def _close(self, tensor: str, state: TensorState) -> None:
        pushes = [state.pushed[w] for w in sorted(state.pushed)]
        indices, values = sum_pushes(pushes, state.numel)
        if self.mode == "topk":
            total = state.residual.copy()
            total[indices] += values
            if np.isfinite(total).all():
                k = min(max(f.count for f in pushes), state.numel)
                indices = np.sort(np.argpartition(-np.abs(total), k - 1)[:k]) if k else \
                    np.zeros(0, np.int64)
                values = total[indices]
                total[indices] = 0.0
                state.residual = total
            else:
                indices = np.arange(state.numel)
                values = total
        state.last = Finished(state.round, indices.astype(np.int64, copy=False),
                              values.astype(np.float32, copy=False))
        self.closed_rounds += 1
        self._finish(tensor, state, None)

    def _expire_locked(self) -> None:
        now = self.clock()
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
            state.last = Finished(state.round, error=error)
            self.failed_rounds += 1
            self._finish(tensor, state, error)

    def _finish(self, tensor: str, state: TensorState, error: str | None) -> None:
        self.events.append((tensor, state.round, error))
        state.round += 1
        state.pushed = {}
        state.opened = None
        state.resumed = False
        self._cond.notify_all()

    def _try_pull_locked(self, frame: Frame) -> bytes | None:
        state = self.tensors.get(frame.tensor)
        if state is None:
            raise UnknownTensor(f"{frame.where()}: no worker has pushed this tensor to this "
                                "server (was the server restarted without a checkpoint?)")
        self._check_numel(state, frame)
        last = state.last
        if last is not None and frame.round == last.round:
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
