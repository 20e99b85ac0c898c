"""Names, environment variables and envelopes shared by the parameter-server client and
server (no torch): the one home of every ``HVD_COMPRESS_PS*`` name a user sets.

Imported by the client's transports (:mod:`hvd_compress.comm.ps_transport`), the bindings
(:mod:`hvd_compress.binding`) and :mod:`ps_server` (which must run without torch,
TensorFlow or Horovod: numpy, grpcio, mpi4py and the native sparse kernels only). The
frames themselves are :mod:`hvd_compress.sparse_wire`.

Environment
    :data:`PS_ENV` (where the servers are when ``ps=`` is not given), :data:`TOKEN_ENV`,
    :data:`CA_ENV`, :data:`CONNECT_TIMEOUT_ENV`, :data:`RETRY_TIMEOUT_ENV` and
    :data:`PARTIAL_ENV`.

gRPC
    Service :data:`GRPC_SERVICE` with unary-unary methods ``Push`` and ``Pull``
    (:data:`GRPC_PUSH`, :data:`GRPC_PULL`), raw frame ``bytes`` both ways; ``Push`` answers
    ``b"accepted"`` or ``b"duplicate"``. With a token, every call except the standard
    health service carries metadata ``authorization: Bearer <token>``
    (:func:`token_metadata`); the token comes from ``$HVD_COMPRESS_PS_TOKEN``
    (:data:`TOKEN_ENV`) when not given explicitly. Every push and pull of
    :class:`~hvd_compress.comm.ps_transport.grpc.PSClient` also carries the worker's identity,
    binary metadata :data:`IDENTITY_METADATA` (:func:`identity_metadata`): a random
    secret the client process draws once, its worker id and the tensor's session. The
    server binds each (session, worker) to the first secret it sees and refuses, from the
    metadata alone, a call of that worker carrying another one (``PERMISSION_DENIED``);
    see :mod:`ps_server.store`.
MPI (MPMD ``mpirun``)
    After :func:`split_world`, a worker sends pickled ``(op, frame)`` tuples with tag
    :data:`MPI_REQUEST_TAG`, ``op`` one of :data:`MPI_OPS`; the server replies
    ``(code, payload)`` with tag :data:`MPI_REPLY_TAG`, ``code`` :data:`MPI_OK` with the
    reply bytes, or a gRPC status name with the error message. A worker's id is its
    rank among the worker ranks, and the server checks every frame against the rank it
    came from (the MPI library tells the source of each message, which no process can
    choose), so MPI needs no identity binding.
Quorum rounds (``--quorum``)
    A push for a round that closed without it is refused with status :data:`LATE_STATUS`
    (both transports). The aggregate of a round that summed fewer than all workers says
    how many it missed in its frame's worker field (:func:`quorum_sender`,
    :func:`missing_of`); a full round's aggregate carries ``SERVER_ID`` as before. The
    refusal's message ends with the round the server has open (:func:`late_detail`,
    :func:`open_round_of`), so a late worker knows which rounds closed without it and
    skips them (:class:`~hvd_compress.comm.parameter_server.ParameterServerCommunicator`).
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
from collections.abc import Callable
from typing import Any

PS_ENV = "HVD_COMPRESS_PS"
"""Where the servers are when ``ps=`` is not given: a spec that
:func:`hvd_compress.comm.ps_transport.check_spec` accepts (``grpc://h:p,h:p``,
``grpcs://...`` for TLS, or ``mpi``); empty means no servers."""
TOKEN_ENV = "HVD_COMPRESS_PS_TOKEN"
"""The servers' bearer token when ``token=`` (client) or ``--token-file`` (server) is not
given."""
CA_ENV = "HVD_COMPRESS_PS_CA"
"""Path of the PEM certificate a worker trusts for ``grpcs://`` servers."""
CONNECT_TIMEOUT_ENV = "HVD_COMPRESS_PS_CONNECT_TIMEOUT"
"""Default seconds a gRPC client retries a server it never reached."""
RETRY_TIMEOUT_ENV = "HVD_COMPRESS_PS_RETRY_TIMEOUT"
"""Default seconds a gRPC client retries a server that answered before (a restart)."""
PARTIAL_ENV = "HVD_COMPRESS_PS_PARTIAL"
"""What a round a server quorum closed without every worker applies, when ``partial=`` is
not given (:data:`hvd_compress.comm.parameter_server.PARTIAL`): how the optimizers of
both bindings, which build their communicator themselves, are told."""

GRPC_SERVICE = "hvd_compress.ps.ParameterServer"
GRPC_PUSH = f"/{GRPC_SERVICE}/Push"
GRPC_PULL = f"/{GRPC_SERVICE}/Pull"
PUSH_ACCEPTED = b"accepted"
PUSH_DUPLICATE = b"duplicate"
TOKEN_METADATA = "authorization"
JOB_SIZE_METADATA = "hvd-job-workers"  # the client's number of workers, on every call
IDENTITY_METADATA = "hvd-worker-identity-bin"  # secret + u32 worker + session (UTF-8)
WORKER_SECRET_BYTES = 16
MPI_REQUEST_TAG = 7301
MPI_REPLY_TAG = 7302
MPI_OPS = ("push", "pull", "bye")
MPI_OK = "OK"
LATE_STATUS = "OUT_OF_RANGE"
"""The status of a push for a round that closed by quorum without it."""
_MAX_MISSING = 1 << 16
_SERVER_ID = 0xFFFFFFFF  # hvd_compress.sparse_wire.SERVER_ID


def quorum_sender(missing: int) -> int:
    """The worker field of an aggregate frame of a round that summed all workers but
    ``missing`` (0: ``SERVER_ID``, as without a quorum): ``SERVER_ID - missing``, far
    above any worker id."""
    if not 0 <= missing < _MAX_MISSING:
        raise ValueError(f"missing workers must be in [0, {_MAX_MISSING}), got {missing}")
    return _SERVER_ID - missing


def missing_of(sender: int) -> int:
    """The number of workers an aggregate frame with worker field ``sender`` did not sum
    (the inverse of :func:`quorum_sender`; 0 for any field outside its range)."""
    missing = _SERVER_ID - sender
    return missing if 0 <= missing < _MAX_MISSING else 0


_OPEN_ROUND = re.compile(r" \[open round (\d+)\]$")


def late_detail(message: str, open_round: int) -> str:
    """A late refusal's message (status :data:`LATE_STATUS`): ``message`` followed by the
    round the server has open, ``" [open round N]"``; every round before ``N`` is closed."""
    return f"{message} [open round {open_round}]"


def open_round_of(detail: str | None) -> int | None:
    """The open round a :func:`late_detail` message names; None for any other text."""
    found = _OPEN_ROUND.search(detail or "")
    return int(found.group(1)) if found else None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC call metadata carrying ``token`` (empty without a token)."""
    return ((TOKEN_METADATA, f"Bearer {token}"),) if token else ()


def session_of(tensor: str) -> str:
    """The session of a tensor name: its part before the first ``/`` (the whole name
    when there is none). :class:`~hvd_compress.comm.parameter_server.ParameterServerCommunicator`
    names tensors ``<session>/<collective name>``."""
    return tensor.split("/", 1)[0]


_WORKER = struct.Struct("<I")


def identity_metadata(session: str, worker: int, secret: bytes) -> tuple[str, bytes]:
    """The call metadata saying that this process, known by ``secret``
    (:data:`WORKER_SECRET_BYTES` random bytes drawn once per client), is worker
    ``worker`` of ``session``: the secret, the worker id (u32) and the session's UTF-8."""
    if len(secret) != WORKER_SECRET_BYTES:
        raise ValueError(f"a worker secret has {WORKER_SECRET_BYTES} bytes, got "
                         f"{len(secret)}")
    return IDENTITY_METADATA, secret + _WORKER.pack(worker) + session.encode()


def parse_identity(value: bytes) -> tuple[str, int, bytes]:
    """``(session, worker, key)`` of an :func:`identity_metadata` value, where ``key`` is
    a 16-byte BLAKE2b digest of the secret (what the server keeps and checkpoints, so its
    files never hold a secret a reader could reuse). Raises ValueError when ``value``
    is not such a value."""
    head = WORKER_SECRET_BYTES + _WORKER.size
    if not isinstance(value, bytes) or len(value) < head:
        raise ValueError(f"metadata {IDENTITY_METADATA} must hold a {WORKER_SECRET_BYTES}-"
                         "byte secret, a u32 worker id and the session name")
    try:
        session = value[head:].decode()
    except UnicodeDecodeError:
        raise ValueError(f"metadata {IDENTITY_METADATA}: the session name is not UTF-8"
                         ) from None
    key = hashlib.blake2b(value[:WORKER_SECRET_BYTES], digest_size=16).digest()
    return session, _WORKER.unpack_from(value, WORKER_SECRET_BYTES)[0], key


def poll_until(ready: Callable[[], bool], longest_sleep: float = 5e-4) -> None:
    """Return once ``ready()`` is true, sleeping between polls (1 µs, doubling up to
    ``longest_sleep`` seconds, the most latency this adds).

    Horovod's ``synchronize`` and a blocking MPI receive spin until their message arrives,
    keeping a core busy that Horovod's background thread, the other ranks on the host and
    the parameter-server client need; waiting through this function leaves it to them.
    """
    sleep = 1e-6
    while not ready():
        time.sleep(sleep)
        sleep = min(2 * sleep, longest_sleep)


def job_size_mismatch(job: int, server: int) -> str:
    """The error of a job of ``job`` workers meeting a server started with ``--workers
    server`` (the same words on every transport and on both sides)."""
    return (f"the job has {job} workers but this server was started with --workers "
            f"{server}: restart the server with --workers {job}, or the job with {server} "
            "workers")


def split_world(world: Any, role: str, shard: int | None = None,
                shards: int | None = None, expected_workers: int | None = None
                ) -> tuple[Any, int, list[int], list[int]]:
    """Collective over ``world``: split workers from servers and exchange who is who.

    Every rank calls it once (workers through
    :class:`~hvd_compress.comm.ps_transport.mpi.MPIPSClient`, servers through
    ``python -m ps_server --transport mpi``). Returns ``(sub, index, servers, workers)``:
    the communicator of this rank's role (workers pass it to ``hvd.init(comm=sub)``), this
    rank's index in it (a worker's id; a server's default shard), the world rank of each
    shard's server in shard order, and the world rank of each worker in worker-id order.

    A server passes its ``--workers`` as ``expected_workers``; the counts travel with the
    roles, so when the world's worker ranks are not that many, every rank (workers and
    servers alike) raises the same :class:`ValueError` naming both numbers, at once,
    rather than the workers waiting for replies that never come.
    """
    if role not in ("worker", "server"):
        raise ValueError(f"role must be 'worker' or 'server', got {role!r}")
    sub = world.Split(0 if role == "worker" else 1, world.Get_rank())
    if role == "server":
        shard = sub.Get_rank() if shard is None else shard
        shards = sub.Get_size() if shards is None else shards
    gathered = world.allgather((role, shard, shards, expected_workers))
    roles = [entry[:3] for entry in gathered]
    workers = [r for r, (who, _, _) in enumerate(roles) if who == "worker"]
    by_shard = {s: r for r, (who, s, _) in enumerate(roles) if who == "server"}
    counts = {n for who, _, n in roles if who == "server"}
    if len(counts) != 1 or sorted(by_shard) != list(range(next(iter(counts)))) or \
            len(by_shard) != sum(who == "server" for who, _, _ in roles):
        raise ValueError(f"MPI server ranks must cover shards 0..N-1 once each with one N; "
                         f"got (role, shard, N) by world rank: {roles}")
    if not workers:
        raise ValueError("no worker ranks in the MPI world")
    for rank, (who, s, _, expected) in enumerate(gathered):
        if who == "server" and expected is not None and expected != len(workers):
            raise ValueError(f"MPI server shard {s} (world rank {rank}): "
                             + job_size_mismatch(len(workers), expected)
                             + f" (worker ranks: {workers})")
    return sub, sub.Get_rank(), [by_shard[s] for s in sorted(by_shard)], workers
