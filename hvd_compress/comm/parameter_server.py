"""A communicator that sends sparse sums to parameter servers and everything else through
Horovod (or any other communicator).

The client comes from :func:`connect`, which picks the transport by the spec's scheme
(:mod:`hvd_compress.comm.ps_transport`); :func:`check_spec`, :func:`connect`,
:func:`init_mpi_workers`, :data:`PS_ENV` and :data:`CA_ENV` are re-exported here for the
bindings and older imports.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import Collective, SparseSum, sum_pairs
from hvd_compress.comm.ps_transport import check_spec as check_spec
from hvd_compress.comm.ps_transport import connect as connect
from hvd_compress.comm.ps_transport.base import PartialSum, PendingRound, ShardedClient
from hvd_compress.comm.ps_transport.mpi import init_mpi_workers as init_mpi_workers
from hvd_compress.comm.staging import pairs_to_device
from hvd_compress.ps_protocol import CA_ENV as CA_ENV  # re-exported: older imports
from hvd_compress.ps_protocol import PARTIAL_ENV
from hvd_compress.ps_protocol import PS_ENV as PS_ENV  # re-exported: ps= when not given

PARTIAL = ("unscaled", "scaled", "owed", "refund")
"""What a round closed without every worker applies (``ParameterServerCommunicator``'s
``partial``); docs/reliability.md#stragglers has their accuracy."""

DEFAULT_PARTIAL = "owed"
"""The default: conserving exactly (as the issue requires) and, of the two designs that
do, the closer to full rounds in accuracy (digits, 5 seeds: docs/reliability.md)."""


@dataclass
class _ServerRound:
    name: str
    op: SparseSum
    pending: PendingRound
    skipped: bool = False  # the round had closed without this worker: nothing was pushed


class ParameterServerCommunicator:
    """:class:`~hvd_compress.comm.ops.SparseSum` through parameter servers, the other
    collectives through ``dense``.

    On the servers a tensor is ``<session>/<collective name>``, with rounds counted from 0
    and advanced on every exchange, failed steps included, identically on every worker.
    ``session`` must be the same on every worker and new for each run of the job (the
    optimizer broadcasts a random one from rank 0), so a job restarted from its checkpoint
    starts fresh rounds while servers that kept running still hold the old ones (they free
    them after ``--idle-timeout``). ``start`` pushes (never waiting for other workers) and
    ``wait`` pulls the aggregate.

    With a server quorum (``--quorum``), ``wait`` returns a
    :class:`~hvd_compress.comm.ps_transport.base.PartialSum` for a round that did not sum
    every worker's pairs or refused this worker's push as late (the sparse schemes keep
    the refused pairs in their residual). ``partial`` says what such a round applies
    (:data:`PARTIAL`; default ``$HVD_COMPRESS_PS_PARTIAL``, which is how the optimizers of
    both bindings are told, else ``"owed"``; every worker, the late one too, gets the same
    result):

    * ``"unscaled"``: the contributors' sum, as it is (averaged over all ``W`` workers:
      a round with ``K`` contributors takes a ``K / W`` step). Exact conservation: the
      sum of every aggregate applied plus every worker's residual equals the sum of every
      gradient computed.
    * ``"scaled"``: each shard's sum times ``W / K`` (the mean over the contributors).
      Not conserving: a late worker's refused pairs stay in its residual and arrive
      later, so the mass the scaling stood in for them is applied twice.
    * ``"owed"`` (the default): scaled, and each worker missing from a shard owes what
      the scaling stood in for it (the shard's sum over ``K``): it is taken from its
      residual (the pairs the scheme counts as sent include it) and paid back by its
      later gradients, so conservation is exact again (bit for bit where the scaling is
      exact in float32; with ``values="fp16"`` the residual gives up the owed mass
      rounded to fp16, so it holds up to that rounding).
    * ``"refund"``: scaled, and a worker whose push was refused as late owes the stand-in
      of that round (its gradient arrives later), not of the rounds it skipped (their
      gradients were never computed): conservation holds in expectation only.

    docs/reliability.md#stragglers has the accuracy of each and the step times.

    From a ``--mode gtopk`` server (each shard's aggregate the global top-k of the sum, a
    :attr:`~hvd_compress.sparse_wire.Kind.SELECTED` frame), ``wait`` returns a
    :class:`PartialSum` whose refused pairs are this worker's pairs outside the
    aggregate's indices: the sparse schemes keep them in their residual, so what the
    server left out is sent again in a later round by the workers that pushed it.

    A late refusal names the round ``R`` the server has open, so the worker knows that
    every round before ``R`` closed without it: for those, ``start`` sends no push (a
    pull only) and ``wait`` returns the closed round's aggregate as a :class:`PartialSum`
    refusing every pair, so the scheme keeps them all in its residual. :meth:`behind`
    counts those rounds and round ``R`` itself: a training loop need not compute a
    gradient for them (:func:`skip_behind` drops the loader's batches of those rounds
    and runs a step on zero gradients instead, which applies each round's aggregate,
    keeping replicas identical). For round ``R`` that step pushes the residual's pairs
    (a contribution toward the quorum without a new gradient), so the worker is back in
    step with the others for ``R + 1``; were it to compute ``R``'s gradient it would
    push as late as before, round after round. A late worker thus contributes fewer
    gradients; the samples of the batches it skipped are not computed, the price of any
    quorum.
    """

    def __init__(self, dense: Communicator, client: ShardedClient, session: str,
                 partial: str | None = None) -> None:
        if client.worker != dense.rank:
            raise ValueError(f"parameter-server worker id {client.worker} differs from the "
                             f"rank {dense.rank}; each rank must push as its own worker")
        source = "partial"
        if partial is None:  # what the bindings pass: the environment, else the default
            partial, source = os.environ.get(PARTIAL_ENV) or DEFAULT_PARTIAL, f"${PARTIAL_ENV}"
        if partial not in PARTIAL:
            raise ValueError(f"{source} must be one of {', '.join(PARTIAL)} (what a round "
                             f"closed without every worker applies), got {partial!r}")
        self.dense, self.client, self.session = dense, client, session
        self.partial = partial
        client.expect_workers(dense.size)  # servers that are told check their --workers
        self.rank, self.size = dense.rank, dense.size
        self.ordered = getattr(dense, "ordered", False)
        self._rounds: dict[str, int] = defaultdict(int)
        self._closed: dict[str, int] = {}  # every round below closed without this worker
        self._resync: dict[str, int] = {}  # behind() counts the rounds below
        self.skipped_rounds = 0  # rounds this worker only pulled (see behind())

    def start(self, name: str, op: Collective) -> Any:
        if not isinstance(op, SparseSum):
            return self.dense.start(name, op)
        round = self._rounds[name]
        self._rounds[name] += 1
        tensor = f"{self.session}/{name}"
        if round < self._closed.get(name, 0):  # closed without this worker: pull only
            self.skipped_rounds += 1
            return _ServerRound(name, op, self.client.start(
                tensor, round, op.numel, op.indices[:0], op.values[:0], push=False),
                skipped=True)
        # The pairs' host copy (made once: the byte count has it too).
        return _ServerRound(name, op, self.client.start(tensor, round, op.numel, *op.host))

    def behind(self, open_round: bool = True) -> int:
        """How many of the coming rounds of every sparse tensor closed without this worker
        (as the servers' late refusals told), plus the round open then unless
        ``open_round`` is False (0 when it is not behind): a loop may run that many steps
        without computing gradients (:func:`skip_behind`)."""
        if not self._resync:
            return 0
        extra = 0 if open_round else 1
        return max(0, min(self._resync.get(name, 0) - extra - r
                          for name, r in self._rounds.items()))

    def wait(self, handle: Any) -> torch.Tensor | list[torch.Tensor] | PartialSum:
        if not isinstance(handle, _ServerRound):
            return self.dense.wait(handle)
        indices, values = self.client.finish(handle.pending)
        if any(detail is not None for detail in handle.pending.late):
            closed = handle.pending.closed_before()
            self._closed[handle.name] = max(closed, self._closed.get(handle.name, 0))
            self._resync[handle.name] = max(closed + 1, self._resync.get(handle.name, 0))
        device = handle.op.values.device
        # One part: the servers' aggregate, already summed in worker order.
        parts = pairs_to_device([(indices.numpy(), values.numpy())], device)
        return self._partial(handle, sum_pairs(handle.op.numel, parts, device), indices)

    def _partial(self, handle: _ServerRound, total: torch.Tensor, summed: torch.Tensor
                 ) -> torch.Tensor | PartialSum:
        """``total`` as it is when every shard summed all workers including this one and
        every pair this worker pushed; else a :class:`PartialSum` as ``partial`` says
        (scaled, and what this worker owes), refusing the pairs outside a selected
        aggregate's indices ``summed`` (``--mode gtopk``) too."""
        pending = handle.pending
        counts = tuple(self.size - missing for missing in pending.missing)
        refused = torch.ones_like(handle.op.indices, dtype=torch.bool) if handle.skipped \
            else pending.refused(handle.op.indices)
        if not handle.skipped:
            unselected = pending.unselected(handle.op.indices, summed)
            if unselected is not None:
                refused = unselected if refused is None else refused | unselected
        if refused is None and min(counts) >= self.size:
            return total
        owed = None
        if self.partial != "unscaled":
            for s, k in enumerate(counts):
                if k >= self.size:
                    continue
                shard = slice(pending.bounds[s], pending.bounds[s + 1])
                if self._owes(handle, s):  # the stand-in for this worker: the sum over K
                    owed = torch.zeros_like(total) if owed is None else owed
                    owed[shard] = total[shard] / k
                total[shard] *= self.size / k
        return PartialSum(total, refused, counts, owed)

    def _owes(self, handle: _ServerRound, shard: int) -> bool:
        """Whether this worker owes the stand-in the scaling applied for it on ``shard``:
        ``owed``, a shard it missed (pull-only round or late push); ``refund``, a late
        push only (its pairs arrive later; a skipped round's gradient never existed)."""
        late = handle.pending.late[shard] is not None if handle.pending.late else False
        if self.partial == "owed":
            return handle.skipped or late
        return self.partial == "refund" and late and not handle.skipped


T = TypeVar("T")


def skip_behind(batches: Iterable[T], comm: Any,
                skip_step: Callable[[], Any] | None = None,
                compute_open: bool = False) -> Iterator[T]:
    """``batches``, less those of the rounds that closed without this worker.

    Wrap a training loop's loader with it and the loop needs no other change::

        for batch in skip_behind(loader, optimizer):
            ...  # forward, backward, optimizer.step() as before

    Before yielding each batch, while the communicator is :meth:`behind
    <ParameterServerCommunicator.behind>`, the batch is dropped and ``skip_step`` runs
    instead: a step on zero gradients, which pushes nothing and applies the closed
    round's aggregate, so this worker's parameters stay identical to the others' and its
    unsent gradient mass stays in its residual. Every worker thus runs the same number of
    rounds per pass over its loader; a late one computes fewer gradients (the samples of
    the dropped batches are the price of the quorum).

    ``comm``: a :class:`ParameterServerCommunicator`, or an object holding one (a
    ``hvd_compress.torch`` optimizer, a :class:`~hvd_compress.pipeline.Pipeline`);
    without one (no servers) every batch is yielded. ``skip_step`` defaults to
    ``comm.zero_grad(); comm.step()`` for an optimizer (whose ``step`` sends zeros for
    parameters without a gradient). ``compute_open``: compute a gradient for the round
    open when the refusal came (rather than a step on zeros that pushes the residual
    only), at the risk of being late for it again. docs/reliability.md#stragglers has
    measurements.
    """
    if skip_step is None:
        skip_step = partial(_zero_step, comm)
    for batch in batches:
        server = _find_communicator(comm)  # looked up again: an elastic reset replaces it
        if server is not None and server.behind(open_round=not compute_open) > 0:
            skip_step()
            continue
        yield batch


def _find_communicator(obj: Any) -> ParameterServerCommunicator | None:
    for candidate in (obj, getattr(obj, "comm", None),
                      getattr(getattr(obj, "_pipeline", None), "comm", None)):
        if isinstance(candidate, ParameterServerCommunicator):
            return candidate
    return None


def _zero_step(optimizer: Any) -> None:
    if not hasattr(optimizer, "step"):
        raise TypeError(f"skip_behind needs skip_step= for a {type(optimizer).__name__} "
                        "(the step to run without gradients)")
    optimizer.zero_grad()
    optimizer.step()
