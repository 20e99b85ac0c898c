"""The MPI transport: ``ps="mpi"``, servers as extra ranks of the workers' MPMD
``mpirun`` (``python -m ps_server --transport mpi``), reached over ``MPI.COMM_WORLD``.

The workers join the servers once, collectively, before Horovod starts
(:func:`init_mpi_workers`, called by ``hvd_compress.torch.init(ps="mpi")`` and its
TensorFlow twin), and Horovod then runs on the workers' communicator. A worker's id is
its rank among the workers, which the servers check against the source of each message,
so this transport needs no token or identity secret.
"""

from __future__ import annotations

import atexit
from typing import Any

from hvd_compress.comm.ps_transport.base import (
    LATE,
    PendingRound,
    ShardedClient,
    SpecError,
    Transport,
    join_forms,
)
from hvd_compress.ps_protocol import MPI_REPLY_TAG, MPI_REQUEST_TAG, poll_until, split_world


class MPIPSClient(ShardedClient):
    """Client of parameter servers running as extra ranks of the same MPMD ``mpirun``.

    Collective at construction (see :func:`split_world`); ``self.comm`` is the workers'
    communicator. Requests are pickled ``(op, frame)`` tuples with tag
    :data:`MPI_REQUEST_TAG`, replies ``(code, payload)`` with :data:`MPI_REPLY_TAG`,
    ``code`` ``"OK"`` or a gRPC status name with the error message as payload.
    """

    def __init__(self, world: Any = None, value_dtype: str | None = None) -> None:
        if world is None:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
        self.world = world
        self.comm, worker, self.servers, _ = split_world(world, "worker")
        super().__init__(worker, value_dtype)
        self.addresses = [f"mpi rank {r}" for r in self.servers]

    def _send_pushes(self, pending: PendingRound) -> None:
        if not pending.pull_only:
            self.exchange(pending.tensor, pending.round, "push", pending.pushes, pending.late)

    def _pull(self, pending: PendingRound) -> list[bytes]:
        return self.exchange(pending.tensor, pending.round, "pull", pending.pulls)

    def exchange(self, tensor: str, round: int, op: str, frames: list[bytes],
                 late: list[str | None] | None = None) -> list[bytes]:
        """Send ``op`` (``"push"`` or ``"pull"``) with one encoded frame per shard to every
        server at once; return the replies' payloads in shard order, or raise
        :class:`PSError` naming ``tensor`` and ``round`` for the first shard that refused.
        With ``late`` (one entry per shard), a shard's refusal as late
        (:data:`~hvd_compress.comm.ps_transport.base.LATE`) is not raised: its message
        goes to ``late[shard]``."""
        sends = [self.world.isend((op, frame), dest=rank, tag=MPI_REQUEST_TAG)
                 for rank, frame in zip(self.servers, frames)]
        replies = []
        for rank in self.servers:  # a blocking recv would spin while the server works
            poll_until(lambda rank=rank: self.world.Iprobe(source=rank, tag=MPI_REPLY_TAG))
            replies.append(self.world.recv(source=rank, tag=MPI_REPLY_TAG))
        for request in sends:
            request.wait()
        for shard, (code, payload) in enumerate(replies):
            if code == LATE and late is not None:
                late[shard] = payload
            elif code != "OK":
                raise self._error(tensor, round, shard, code, payload)
        return [payload for _, payload in replies]

    def close(self) -> None:
        """Tell every server this worker is done (a server exits when all workers are)."""
        for rank in self.servers:
            self.world.send(("bye", b""), dest=rank, tag=MPI_REQUEST_TAG)


_joined: MPIPSClient | None = None


def init_mpi_workers() -> Any:
    """Join an MPMD ``mpirun`` whose other ranks run ``python -m ps_server --transport mpi``.

    Collective over ``MPI.COMM_WORLD`` (servers call their side at start-up). Returns the
    workers' communicator, to pass to ``hvd.init(comm=...)``; ``ps="mpi"`` then uses this
    connection (:func:`joined_client`). Calling it again returns the same communicator.
    At exit, the process tells the servers it is done (they exit when every worker has).
    Raises ``ValueError`` when the world has no consistent set of server ranks.
    """
    global _joined
    if _joined is None:
        _joined = MPIPSClient()
        # The servers exit once every worker has said goodbye; atexit runs this before
        # mpi4py finalizes MPI (registered earlier, so run later).
        atexit.register(_joined.close)
    return _joined.comm


def joined_client() -> MPIPSClient | None:
    """The client made by :func:`init_mpi_workers`, or ``None`` before it ran."""
    return _joined


class MPITransport(Transport):
    """The spec ``mpi``: the servers joined by :func:`init_mpi_workers`."""

    schemes = ("mpi",)
    forms = ("'mpi'",)
    in_launch = True

    def check(self, spec: str, origin: str) -> str:
        if spec.strip().lower() != "mpi":
            raise SpecError(f"invalid parameter server address {spec!r} in {origin}="
                            f"{spec!r}: the MPI transport takes no address, only 'mpi'",
                            join_forms(list(self.forms)))
        return "mpi"

    def connect(self, spec: str, worker: int, *, workers: int | None = None,
                connect_timeout: float | None = None, retry_timeout: float | None = None
                ) -> MPIPSClient:
        client = joined_client()
        if client is None:
            raise RuntimeError("ps='mpi' needs the MPI connection to the servers first: call "
                               "hvd_compress.torch.init(ps='mpi') (or, with TensorFlow, "
                               "hvd_compress.tensorflow.init(ps='mpi')) instead of "
                               "hvd.init(); it splits the servers off MPI.COMM_WORLD and "
                               "starts Horovod on the workers")
        if client.worker != worker:
            raise RuntimeError(f"Horovod rank {worker} differs from this process's worker id "
                               f"{client.worker} among the MPI workers; start Horovod "
                               "with hvd_compress.torch.init(ps='mpi') or "
                               "hvd_compress.tensorflow.init(ps='mpi')")
        return client

    def start_workers(self) -> Any:
        return init_mpi_workers()
