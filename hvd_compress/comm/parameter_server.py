"""A communicator that sends sparse sums to parameter servers and everything else through
Horovod (or any other communicator).

The client comes from :func:`connect`, which picks the transport by the spec's scheme
(:mod:`hvd_compress.comm.ps_transport`); :func:`check_spec`, :func:`connect`,
:func:`init_mpi_workers`, :data:`PS_ENV` and :data:`CA_ENV` are re-exported here for the
bindings and older imports.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import Collective, SparseSum, sum_pairs
from hvd_compress.comm.ps_transport import check_spec as check_spec
from hvd_compress.comm.ps_transport import connect as connect
from hvd_compress.comm.ps_transport.base import PartialSum, PendingRound, ShardedClient
from hvd_compress.comm.ps_transport.mpi import init_mpi_workers as init_mpi_workers
from hvd_compress.comm.staging import pairs_to_device
from hvd_compress.ps_protocol import CA_ENV as CA_ENV  # re-exported: older imports
from hvd_compress.ps_protocol import PS_ENV as PS_ENV  # re-exported: ps= when not given


@dataclass
class _ServerRound:
    op: SparseSum
    pending: PendingRound


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
    the refused pairs in their residual); ``scale_partial`` (default True) multiplies
    each shard's sum by ``W / contributors`` so that the job's average is the mean over
    the workers that contributed. Every worker, the late one too, gets the same result.
    docs/reliability.md#stragglers has the step times measured with it.
    """

    def __init__(self, dense: Communicator, client: ShardedClient, session: str,
                 scale_partial: bool = True) -> None:
        if client.worker != dense.rank:
            raise ValueError(f"parameter-server worker id {client.worker} differs from the "
                             f"rank {dense.rank}; each rank must push as its own worker")
        self.dense, self.client, self.session = dense, client, session
        self.scale_partial = scale_partial
        client.expect_workers(dense.size)  # servers that are told check their --workers
        self.rank, self.size = dense.rank, dense.size
        self.ordered = getattr(dense, "ordered", False)
        self._rounds: dict[str, int] = defaultdict(int)

    def start(self, name: str, op: Collective) -> Any:
        if not isinstance(op, SparseSum):
            return self.dense.start(name, op)
        round = self._rounds[name]
        self._rounds[name] += 1
        # The pairs' host copy (made once: the byte count has it too).
        return _ServerRound(op, self.client.start(f"{self.session}/{name}", round, op.numel,
                                                  *op.host))

    def wait(self, handle: Any) -> torch.Tensor | list[torch.Tensor] | PartialSum:
        if not isinstance(handle, _ServerRound):
            return self.dense.wait(handle)
        indices, values = self.client.finish(handle.pending)
        device = handle.op.values.device
        # One part: the servers' aggregate, already summed in worker order.
        parts = pairs_to_device([(indices.numpy(), values.numpy())], device)
        return self._partial(handle, sum_pairs(handle.op.numel, parts, device))

    def _partial(self, handle: _ServerRound, total: torch.Tensor
                 ) -> torch.Tensor | PartialSum:
        """``total`` as it is when every shard summed all workers including this one;
        else a :class:`PartialSum` (scaled when ``scale_partial``)."""
        pending = handle.pending
        counts = tuple(self.size - missing for missing in pending.missing)
        refused = pending.refused(handle.op.indices)
        if refused is None and min(counts) >= self.size:
            return total
        if self.scale_partial:
            for s, k in enumerate(counts):
                if k < self.size:
                    total[pending.bounds[s]:pending.bounds[s + 1]] *= self.size / k
        return PartialSum(total, refused, counts)
