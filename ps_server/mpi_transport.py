"""The MPI transport: server ranks of an MPMD ``mpirun``, one event loop per server.

Launch, for example::

    mpirun -np 2 python worker.py : -np 1 python -m ps_server --transport mpi --workers 2

Every rank first calls :func:`hvd_compress.ps_protocol.split_world` (workers through
:class:`~hvd_compress.comm.ps_client.MPIPSClient`). The loop receives ``(op, frame)``
requests, answers pushes at once and parks pulls until their round finishes or fails;
it only ever touches MPI from one thread. It returns when every worker has said ``bye``.

Worker identity needs no binding here (unlike gRPC, see :mod:`ps_server.store`): a
worker's id is its rank's index among the worker ranks, the MPI library tells the server
which rank each message came from (a process cannot choose its source rank), and every
frame must name that rank's worker id or it is refused.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hvd_compress.ps_protocol import MPI_REPLY_TAG, MPI_REQUEST_TAG, poll_until
from hvd_compress.sparse_wire import Frame
from ps_server.service import ShardService
from ps_server.store import RequestError

log = logging.getLogger("ps_server")


class _Replies:
    """Replies in flight. A blocking send of an aggregate waits for its worker to post the
    receive (MPI's rendezvous for large messages), so replies to several workers would go
    out one wake-up at a time; these are non-blocking sends, completed as the loop runs."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.in_flight: list[Any] = []

    def send(self, dest: int, code: str, payload: Any) -> None:
        self.in_flight.append(self.world.isend((code, payload), dest=dest, tag=MPI_REPLY_TAG))
        self.in_flight = [request for request in self.in_flight if not request.Test()]

    def finish(self) -> None:
        """Wait (politely) until every reply has been received."""
        for request in self.in_flight:
            poll_until(request.Test)
        self.in_flight = []


def serve(service: ShardService, world: Any, workers: list[int], max_idle_sleep: float = 2e-4
          ) -> None:
    """Serve requests from the worker ranks ``workers`` of ``world`` until all say bye.

    While idle, the loop polls with a sleep growing from 10 µs to ``max_idle_sleep`` (a
    blocking probe would spin a core the workers on the host need, and every request may
    wait up to that long), and checks deadlines and parked pulls at most every 20 ms.
    Replies are sent without blocking (see :class:`_Replies`). With checkpoints, parked
    pulls are also answered as soon as the journal writer has made their round durable.
    """
    from mpi4py import MPI

    worker_of = {rank: w for w, rank in enumerate(workers)}
    active = set(workers)
    parked: list[tuple[int, Frame]] = []
    replies = _Replies(world)
    status = MPI.Status()
    idle, next_tick, durable = 0.0, 0.0, service.store.durable_version
    service.store.freeze_gap = 2.0  # ticks come every 20 ms while idle
    while active:
        if parked and service.store.durable_version != durable:  # the journal caught up
            durable = service.store.durable_version
            parked = _answer_parked(service, replies, parked)
        if not world.Iprobe(source=MPI.ANY_SOURCE, tag=MPI_REQUEST_TAG, status=status):
            if time.monotonic() >= next_tick:
                service.tick()
                parked = _answer_parked(service, replies, parked)
                next_tick = time.monotonic() + 0.02
            idle = min(max(2 * idle, 1e-5), max_idle_sleep)
            time.sleep(idle)
            continue
        idle = 0.0
        source = status.Get_source()
        op, payload = world.recv(source=source, tag=MPI_REQUEST_TAG)
        peer = f"mpi rank {source}"
        if source not in worker_of:
            log.warning("ignored %r from rank %d, which is not a worker", op, source)
            continue
        if op == "bye":
            active.discard(source)
            log.info("worker %d (rank %d) is done; %d still active", worker_of[source],
                     source, len(active))
            continue
        try:
            if op == "push":
                replies.send(source, "OK", service.push(payload, peer, worker_of[source]))
                parked = _answer_parked(service, replies, parked)
                continue
            if op != "pull":
                raise RequestError(f"unknown MPI request {op!r}; expected push, pull or bye")
            parked.append((source, service.decode_pull(payload, peer, worker_of[source])))
            parked = _answer_parked(service, replies, parked)
        except RequestError as err:
            replies.send(source, err.code, str(err))
    replies.finish()


def _answer_parked(service: ShardService, replies: _Replies, parked: list[tuple[int, Frame]]
                   ) -> list[tuple[int, Frame]]:
    """Reply to every parked pull whose round has finished; keep the others."""
    waiting = []
    for source, frame in parked:
        try:
            result = service.try_pull(frame, f"mpi rank {source}")
        except RequestError as err:
            replies.send(source, err.code, str(err))
            continue
        if result is None:
            waiting.append((source, frame))
        else:
            replies.send(source, "OK", result)
    return waiting
