"""What makes a shard's state durable: change records, snapshots and their replay.

With ``durable=True`` (the server keeps checkpoints), :class:`~ps_server.store.ShardStore`
queues each finished round as a :class:`Change` (taken by
:meth:`~ps_server.store.ShardStore.take_changes`) and holds its aggregate back from
pulls until the journal writer has written that record and called
:meth:`~ps_server.store.ShardStore.mark_durable`. So any aggregate a worker has seen
survives a crash of the server, and after a restart the server is at, or past, the round
of every worker: the workers resume in agreement. Change records hold the round's *union
sum* (not the top-k aggregate) so that :func:`replay` recomputes the same aggregate and
server residual through the same code as the live close
(:func:`ps_server.rounds.aggregate`).

A new worker binding (:mod:`ps_server.identity`) is queued as a change record ahead of any
round its worker's pushes close, so a round a worker has seen is never on disk without
the bindings of those who pushed it. A binding not yet written when the server died
belonged to rounds nobody saw, and is learned again from the first call after the
restart. An expired tensor is queued as a ``dropped`` record. A round that closed by
quorum without every worker records its contributors, so after a restart a late push for
it is still refused as late (:class:`~ps_server.errors.LateRound`) rather than taken as
a retransmission.

A failed write takes nothing away: the writer puts what it took back in the queue
(:meth:`~ps_server.store.ShardStore.requeue`) and retries; see :mod:`ps_server.service`.
The files are :mod:`ps_server.checkpoint`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ps_server.identity import BindingRecord, WorkerBindings
from ps_server.rounds import Finished, TensorState, aggregate, new_state

CONFIG = ("workers", "shard", "shards", "mode")
"""The settings a snapshot or journal must share with the server that reads it."""


@dataclass
class Change:
    """One journal record: round ``round`` of ``tensor`` finished (``indices`` and
    ``values`` are the union indices and float32 sums of its pushes, ``k`` the most pairs
    a worker pushed, ``contributors`` the workers summed when not all were), or failed
    with ``error``; or, with ``dropped``, the tensor expired; or, with ``binding``, a
    worker of session ``tensor`` was bound or freed."""

    tensor: str
    round: int = 0
    numel: int = 0
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    k: int = 0
    error: str | None = None
    dropped: bool = False
    binding: BindingRecord | None = None
    contributors: tuple[int, ...] | None = None


def snapshot(config: dict[str, Any], tensors: dict[str, TensorState],
             bindings: WorkerBindings) -> dict[str, Any]:
    """Everything a restarted server needs: ``config`` (:data:`CONFIG`), each tensor's
    round, residual and last aggregate, and the worker bindings (rows of
    ``[session, *record]``)."""
    saved = {}
    for name, s in tensors.items():
        last = s.last
        saved[name] = {
            "numel": s.numel, "round": s.round,
            "residual": None if s.residual is None else s.residual.copy(),
            "last": None if last is None else {
                "round": last.round, "error": last.error,
                "indices": last.indices, "values": last.values,
                "contributors": list(last.contributors)},
        }
    return {**config, "tensors": saved, "bindings": bindings.rows()}


def restore(config: dict[str, Any], saved: dict[str, Any], now: float
            ) -> dict[str, TensorState]:
    """The tensors of a :func:`snapshot`; refuses one from a differently configured
    server (``ValueError``, naming both configurations)."""
    theirs = {key: saved.get(key) for key in config}
    if theirs != config:
        raise ValueError(f"checkpoint was written by a server with {theirs}, this one "
                         f"has {config}: use a matching configuration or another "
                         "--checkpoint-dir")
    tensors = {}
    for name, t in saved["tensors"].items():
        last = t["last"]
        tensors[name] = TensorState(
            numel=t["numel"], round=t["round"], residual=t["residual"], touched=now,
            last=None if last is None else Finished(
                last["round"], last["indices"], last["values"], last["error"],
                contributors=tuple(last.get("contributors", ()))))
    return tensors


def replay(changes: list[Change], mode: str, tensors: dict[str, TensorState],
           bindings: WorkerBindings, now: float) -> int:
    """Apply journal records on top of a restored snapshot; how many rounds and expiries
    applied (worker bindings are applied and not counted).

    A record at or behind a tensor's open round minus one was already in the snapshot
    and is skipped; one beyond the open round means the journal does not belong to the
    snapshot (``ValueError``).
    """
    applied = 0
    for c in changes:
        if c.binding is not None:
            bindings.apply(c.tensor, c.binding, now)
            continue
        if c.dropped:
            applied += tensors.pop(c.tensor, None) is not None
            continue
        state = tensors.get(c.tensor)
        if state is None:
            state = tensors[c.tensor] = new_state(mode, c.numel, c.round, now)
        if c.round < state.round:
            continue
        if c.round > state.round:
            raise ValueError(f"journal record for round {c.round} of tensor {c.tensor!r}, "
                             f"but the snapshot is at round {state.round}")
        if c.error is not None:
            state.last = Finished(c.round, error=c.error)
        else:
            state.last = Finished(c.round, *aggregate(mode, state, c.indices, c.values, c.k),
                                  contributors=c.contributors or ())
        state.round += 1
        state.touched = now
        applied += 1
    return applied
