"""A communicator that sends sparse sums to parameter servers and everything else through
Horovod (or any other communicator)."""

from __future__ import annotations

import atexit
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hvd_compress.binding import PS_ENV as PS_ENV  # re-exported: ps= when not given
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import Collective, SparseSum, sum_pairs
from hvd_compress.comm.ps_client import (
    ACCEPTED_FORMS,
    MPIPSClient,
    PendingRound,
    PSClient,
    parse_addresses,
)
from hvd_compress.comm.staging import pairs_to_device

CA_ENV = "HVD_COMPRESS_PS_CA"
"""Path of the PEM certificate to trust for ``grpcs://`` servers."""

_mpi_client: MPIPSClient | None = None


def init_mpi_workers() -> Any:
    """Join an MPMD ``mpirun`` whose other ranks run ``python -m ps_server --transport mpi``.

    Collective over ``MPI.COMM_WORLD`` (servers call their side at start-up). Returns the
    workers' communicator, to pass to ``hvd.init(comm=...)``; ``ps="mpi"`` then uses this
    connection. Calling it again returns the same communicator. At exit, the process tells
    the servers it is done (they exit when every worker has).
    """
    global _mpi_client
    if _mpi_client is None:
        _mpi_client = MPIPSClient()
        # The servers exit once every worker has said goodbye; atexit runs this before
        # mpi4py finalizes MPI (registered earlier, so run later).
        atexit.register(_mpi_client.close)
    return _mpi_client.comm


def check_spec(spec: str, origin: str = "ps") -> str:
    """``spec`` checked for syntax only (nothing is contacted): ``"mpi"``, or the servers'
    addresses as :func:`~hvd_compress.comm.ps_client.parse_addresses` accepts them.

    Returns it stripped (``"mpi"`` in lower case). Raises ``ValueError`` naming the bad
    address and the accepted forms, ``TypeError`` when ``spec`` is not a string; ``origin``
    names where it came from in the message (``"ps"``, or ``"$HVD_COMPRESS_PS"``).
    """
    if not isinstance(spec, str):
        raise TypeError(f"{origin} must be a string, {ACCEPTED_FORMS}; got "
                        f"{type(spec).__name__} {spec!r}")
    spec = spec.strip()
    if spec.lower() == "mpi":
        return "mpi"
    parse_addresses(spec, origin)
    return spec


def connect(spec: str, worker: int, *, workers: int | None = None,
            connect_timeout: float | None = None, retry_timeout: float | None = None
            ) -> PSClient | MPIPSClient:
    """The client for ``spec`` (see :data:`PS_ENV`), as worker ``worker`` of a job of
    ``workers`` (told to gRPC servers, which refuse another ``--workers``; the
    communicator sets it from its size when not given here).

    ``connect_timeout`` and ``retry_timeout`` are :class:`PSClient`'s (defaults from
    ``$HVD_COMPRESS_PS_CONNECT_TIMEOUT`` and ``$HVD_COMPRESS_PS_RETRY_TIMEOUT``); the MPI
    transport has no connection to wait for and ignores them.
    """
    if check_spec(spec) == "mpi":
        if _mpi_client is None:
            raise RuntimeError("ps='mpi' needs the MPI connection to the servers first: call "
                               "hvd_compress.torch.init(ps='mpi') (or, with TensorFlow, "
                               "hvd_compress.tensorflow.init(ps='mpi')) instead of "
                               "hvd.init(); it splits the servers off MPI.COMM_WORLD and "
                               "starts Horovod on the workers")
        if _mpi_client.worker != worker:
            raise RuntimeError(f"Horovod rank {worker} differs from this process's worker id "
                               f"{_mpi_client.worker} among the MPI workers; start Horovod "
                               "with hvd_compress.torch.init(ps='mpi') or "
                               "hvd_compress.tensorflow.init(ps='mpi')")
        return _mpi_client
    ca = os.environ.get(CA_ENV)
    return PSClient(spec, worker, root_certificates=Path(ca).read_bytes() if ca else None,
                    workers=workers, connect_timeout=connect_timeout,
                    retry_timeout=retry_timeout)


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
    """

    def __init__(self, dense: Communicator, client: PSClient | MPIPSClient,
                 session: str) -> None:
        if client.worker != dense.rank:
            raise ValueError(f"parameter-server worker id {client.worker} differs from the "
                             f"rank {dense.rank}; each rank must push as its own worker")
        self.dense, self.client, self.session = dense, client, session
        if isinstance(client, PSClient) and client.job_size is None:
            client.job_size = dense.size  # the servers check it against their --workers
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

    def wait(self, handle: Any) -> torch.Tensor | list[torch.Tensor]:
        if not isinstance(handle, _ServerRound):
            return self.dense.wait(handle)
        indices, values = self.client.finish(handle.pending)
        device = handle.op.values.device
        # One part: the servers' aggregate, already summed in worker order.
        parts = pairs_to_device([(indices.numpy(), values.numpy())], device)
        return sum_pairs(handle.op.numel, parts, device)
